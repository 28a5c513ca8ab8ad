"""The seccomp filter of bubblewrap sandboxes, compiled with libseccomp (through ctypes).

In the spirit of Docker's default profile, as a deny list (everything else is allowed):
the syscalls below fail with EPERM inside a sandbox; ``clone3`` fails with ENOSYS (its
flags live in memory a filter cannot read, and ENOSYS makes glibc fall back to
``clone``, whose flags it can); ``clone`` with a namespace flag fails with EPERM, and so
does ``personality`` setting a flag the kernel clears on setuid exec (no ASLR, READ_IMPLIES_EXEC,
...; querying passes). Only the native ABI
passes: any other (the x32 ABI, i386 through ``int 0x80``) kills the process.

``compile_filter`` returns the cBPF program (``seccomp_export_bpf``) that ``bwrap
--seccomp FD`` loads right before it execs the command, so bwrap's own setup (mounts,
namespaces) is unaffected. env-pool compiles it once per node (``bwrap.system_args``).
libseccomp itself (``libseccomp.so.2``, Debian's ``libseccomp2``) is all it needs: no
Python binding, no compiler.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import tempfile

# What a sandboxed command must never do. Most also need a capability the sandbox lacks
# (bwrap drops them all); the filter is the second wall, and the only one against new
# user namespaces (which would hand the command a full set of capabilities in them).
DENIED = (
    # other processes' memory and registers
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "pidfd_getfd",
    "kcmp",
    # mounts, old API and new
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    # namespaces
    "unshare",
    "setns",
    # kernel keyring, BPF, perf, io_uring, userfaultfd: big kernel attack surface, no use here
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # the machine itself
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "syslog",
    "vhangup",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    "iopl",
    "ioperm",
    "fanotify_init",
    # file handles bypass path permissions; obsolete or legacy interfaces
    "open_by_handle_at",
    "name_to_handle_at",
    "uselib",
    "nfsservctl",
    "_sysctl",
    "vm86",
    "vm86old",
    "create_module",
    "get_kernel_syms",
    "query_module",
)
ENOSYS_ONLY = ("clone3",)
# clone(2) flags that make a namespace (CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET)
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# personality(2) flags the kernel itself clears on a setuid exec (PER_CLEAR_ON_SETID):
# READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE, ADDR_COMPAT_LAYOUT, MMAP_PAGE_ZERO
UNSAFE_PERSONA_FLAGS = (0x0400000, 0x0040000, 0x0200000, 0x0100000)

_ACT_ALLOW = 0x7FFF0000
_ACT_KILL_PROCESS = 0x80000000
_ATTR_ACT_BADARCH = 2
_ATTR_CTL_OPTIMIZE = 8
_CMP_NE, _CMP_MASKED_EQ = 1, 7


def _errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class SeccompError(RuntimeError):
    """libseccomp is missing or refused the filter."""


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


@functools.cache
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise SeccompError(
            f"libseccomp is not installed ({e}): apt-get install libseccomp2 (scripts/setup.sh does), "
            "or set envpool.seccomp = false"
        ) from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_export_pfc.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise SeccompError(f"libseccomp: {what}: {os.strerror(-rc)}")


def _build():
    """A libseccomp context holding the sandbox policy (the caller releases it)."""
    lib = _lib()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SeccompError("libseccomp: seccomp_init failed")
    try:
        _check(lib.seccomp_attr_set(ctx, _ATTR_ACT_BADARCH, _ACT_KILL_PROCESS), "bad-arch action")
        lib.seccomp_attr_set(ctx, _ATTR_CTL_OPTIMIZE, 2)  # a binary tree by syscall number (libseccomp >= 2.5)

        def rule(action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:  # not a syscall of this architecture (or newer than this libseccomp)
                return
            arr = (_ArgCmp * len(cmps))(*(_ArgCmp(*c) for c in cmps)) if cmps else None
            _check(lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr), f"rule for {name}")

        for name in DENIED:
            rule(_errno(errno.EPERM), name)
        for name in ENOSYS_ONLY:
            rule(_errno(errno.ENOSYS), name)
        for flag in NAMESPACE_FLAGS:  # clone's flags are its first argument on x86-64 and arm64
            rule(_errno(errno.EPERM), "clone", (0, _CMP_MASKED_EQ, flag, flag))
        # personality: EPERM when it would set an unsafe flag. 0xffffffff only queries (and
        # sets every bit), so it must pass; libseccomp (2.5) takes one comparison per argument
        # and rule, so "flag set and not the query" is spelled "flag set and some other bit
        # clear", one rule per other bit (the kernel reads the low 32 bits only).
        for flag in UNSAFE_PERSONA_FLAGS:
            for z in range(32):
                if 1 << z != flag:
                    rule(_errno(errno.EPERM), "personality", (0, _CMP_MASKED_EQ, flag | 1 << z, flag))
    except BaseException:
        lib.seccomp_release(ctx)
        raise
    return ctx


def _export(fn: str) -> bytes:
    lib = _lib()
    ctx = _build()
    try:
        with tempfile.TemporaryFile() as f:
            _check(getattr(lib, fn)(ctx, f.fileno()), fn)
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)


def compile_filter() -> bytes:
    """The sandbox filter as a cBPF program, the format ``bwrap --seccomp`` reads."""
    return _export("seccomp_export_bpf")


def describe_filter() -> str:
    """The same filter in libseccomp's pseudo-C (for reading, not for loading)."""
    return _export("seccomp_export_pfc").decode()
