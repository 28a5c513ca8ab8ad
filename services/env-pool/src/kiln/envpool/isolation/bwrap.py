"""The bubblewrap backend: every command in its own set of Linux namespaces.

Each ``run`` starts ``bwrap`` with: all namespaces unshared (user, pid, ipc, uts, cgroup,
net: only a loopback of its own, so no host service, NATS included, is reachable), a
cleared environment, ``--die-with-parent`` and ``--new-session``, the system (``/usr``
and a short list of ``/etc`` files) mounted read-only, a synthetic ``/etc/passwd`` and
``/etc/group``, a read-only root, a private size-limited tmpfs at ``/tmp``, and the
workspace as the only writable host path, at ``/workspace``. Inside it runs as uid/gid
1000 with no capabilities; on the host, when env-pool is root, as the sandbox's own
unprivileged uid (see ``Identity``), so even a sandbox escape lands in an account that
owns nothing but its workspace. The pid namespace dies with the command: nothing
survives a ``run``.

A seccomp filter (``seccomp.py``; ``envpool.seccomp``, on by default) denies what a
coding command never needs and a kernel exploit or an escape would: ptrace and other
processes' memory, every mount syscall, new namespaces (``unshare``, ``setns``,
``clone`` with a namespace flag, ``clone3``), the keyring, BPF, perf, io_uring,
userfaultfd, modules, kexec, reboot, swap, clocks, file handles, and any ABI but the
native one. It is compiled with libseccomp once per node into ``<node>/etc/seccomp.bpf``
and bwrap loads it (``--seccomp``) right before it execs the command, after its own
mounts.

No host path of the node is visible inside. The command is pid 1
of its namespace (``--as-pid-1``: no bwrap process, whose argv names the node's folder,
is in the sandbox; as pid 1 the command also reaps orphans, and its exit ends the
namespace). The files bwrap reads (the filter, ``passwd``, ``group``) reach it as file
descriptors that the spawner's zygote opens for each command (``System.files``, fds 3,
4, ...; bwrap closes them before the exec), and ``passwd`` and ``group`` are copies
bwrap makes (``--ro-bind-data``), so mountinfo shows ``/bindfileXXXXXX`` for them, not
the node's folder. A bind mount shows its source's path inside the filesystem it comes
from in ``/proc/self/mountinfo``: as root the pool keeps its workspaces on a tmpfs of
their own (``pool.py``), so the ``/workspace`` line shows ``/<sandbox id>``; not as root
it shows ``/kiln-envpool/<node>-<pid>/ws/<sandbox>`` (relative to ``/dev/shm``).
Mountinfo also shows the host's devices and the options of the filesystems bound in
(``/usr``'s device, the tmpfs sizes).
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from kiln.envpool.isolation import seccomp as _seccomp
from kiln.envpool.isolation.sandbox import SANDBOX_PATH, Identity, Limits, Sandbox, spawn
from kiln.envpool.isolation.spawner import FIRST_FILE_FD, Spawner
from kiln.shared.bus import ServiceError
from kiln.shared.contracts import ExecResult

INNER_UID = 1000
_USRMERGE = ("bin", "lib", "lib32", "lib64", "sbin")


class BwrapError(RuntimeError):
    """bubblewrap cannot run here; env-pool refuses to start with the ``bwrap`` backend."""


@functools.cache
def bwrap_binary() -> str:
    found = shutil.which("bwrap")
    if not found:
        raise BwrapError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap (scripts/setup.sh does)")
    return found


@dataclass(frozen=True)
class System:
    """What every sandbox of a node sees (computed once per node), as bwrap options: the
    read-only host system (``mounts``), ``/etc/passwd`` and ``/etc/group`` (``identity``)
    and the seccomp filter (``seccomp``, empty when off). ``files`` are the host files the
    spawner opens for each command at fds 3, 4, ... in this order; the options name those fds."""

    mounts: list[str]
    identity: list[str]
    seccomp: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def sources(self) -> list[str]:
        """Every host path a command needs (a missing one means a broken node)."""
        return [self.mounts[i + 1] for i, a in enumerate(self.mounts) if a == "--ro-bind"] + self.files


def host_system_binds(ro_binds: list[str]) -> list[str]:
    """bwrap options showing the host's system read-only: ``ro_binds`` that exist, and the
    usr-merge tops (``/bin`` etc.) as the links or folders they are here."""
    args: list[str] = []
    for p in ro_binds:
        if os.path.exists(p):
            args += ["--ro-bind", p, p]
    for name in _USRMERGE:
        top = Path("/") / name
        if top.is_symlink():
            args += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            args += ["--ro-bind", str(top), str(top)]
    return args


def system_args(ro_binds: list[str], etc_dir: Path, seccomp: bool = True) -> System:
    """The read-only system every sandbox sees (computed once per node, with the seccomp
    filter when ``seccomp``; ``write_identity_files(etc_dir)`` first)."""
    mounts = host_system_binds(ro_binds)
    files: list[str] = []

    def fd(path: Path) -> str:
        files.append(str(path))
        return str(FIRST_FILE_FD + len(files) - 1)

    # Copied by bwrap into a file of its own, not bound from the node's folder: a bind
    # mount shows its source's host path in /proc/self/mountinfo.
    identity: list[str] = []
    for name in ("passwd", "group"):
        identity += ["--perms", "0644", "--ro-bind-data", fd(etc_dir / name), f"/etc/{name}"]
    filter_args: list[str] = []
    if seccomp:
        bpf = etc_dir / "seccomp.bpf"
        tmp = bpf.with_suffix(".tmp")
        tmp.write_bytes(_seccomp.compile_filter())
        os.chmod(tmp, 0o644)
        os.replace(tmp, bpf)
        filter_args = ["--seccomp", fd(bpf)]
    return System(mounts, identity, filter_args, files)


def write_identity_files(etc_dir: Path) -> None:
    etc_dir.mkdir(parents=True, exist_ok=True)
    (etc_dir / "passwd").write_text(
        f"root:x:0:0::/:/usr/sbin/nologin\nsandbox:x:{INNER_UID}:{INNER_UID}::/workspace:/bin/bash\n"
    )
    (etc_dir / "group").write_text(f"root:x:0:\nsandbox:x:{INNER_UID}:\n")
    for f in (etc_dir, etc_dir / "passwd", etc_dir / "group"):
        os.chmod(f, 0o755 if f.is_dir() else 0o644)


class BwrapSandbox(Sandbox):
    def __init__(self, *args, system: System, **kwargs):
        super().__init__(*args, **kwargs)
        self.system = system
        self.sources = system.sources + [str(self.workspace)]

    def filesystem(self) -> list[str]:
        """The mounts: today's read-only host system with the workspace bound in, or, for
        an environment sandbox (``overlay.py``), its merged view: the whole root for a
        root file system base, ``/workspace`` and ``/opt/kiln`` over the host system else."""
        tmp = ["--proc", "/proc", "--dev", "/dev", "--size", str(self.limits.tmp_bytes), "--tmpfs", "/tmp"]
        env, view = self.environment, self.view
        if view is not None and not env.host_base:
            return ["--bind", str(view.root), "/", *self.system.identity, *tmp]
        mounts = [*self.system.mounts, *self.system.identity, *tmp, "--bind", str(self.workspace), "/workspace"]
        if view is not None and (view.root / "opt" / "kiln").is_dir():
            mounts += ["--ro-bind", str(view.root / "opt" / "kiln"), "/opt/kiln"]
        return [*mounts, "--remount-ro", "/"]  # the root bwrap builds is a tmpfs: writable unless we say so

    def argv(self, argv: list[str]) -> list[str]:
        env_path = list(self.environment.path) if self.environment is not None else []
        env_vars = [
            x
            for k, v in (self.environment.env.items() if self.environment is not None else ())
            for x in ("--setenv", k, v)
        ]
        return [
            bwrap_binary(),
            "--unshare-all",
            "--unshare-user",
            "--uid",
            str(INNER_UID),
            "--gid",
            str(INNER_UID),
            "--hostname",
            "sandbox",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",  # no bwrap process (its argv names host paths) inside the sandbox
            "--clearenv",
            "--setenv",
            "PATH",
            ":".join([*env_path, SANDBOX_PATH]),
            "--setenv",
            "HOME",
            "/workspace",
            "--setenv",
            "TMPDIR",
            "/tmp",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--setenv",
            "PYTHONDONTWRITEBYTECODE",
            "1",
            "--setenv",
            "PYTHONUNBUFFERED",
            "1",
            *env_vars,
            *self.system.seccomp,
            *self.filesystem(),
            "--chdir",
            "/workspace",
            "--",
            *argv,
        ]

    async def run(self, argv: list[str], timeout_s: float) -> ExecResult:
        # bwrap exits before the command starts when a path it binds is gone (this node's
        # files removed under it): a broken node, not the command's result, so it must not
        # reach a caller (a reward harness) as a failing command.
        missing = [p for p in self.sources if not os.path.exists(p)]
        if missing:
            raise ServiceError(
                f"sandbox {self.id} cannot start: {', '.join(missing)} no longer exist on this node", "sandbox_broken"
            )
        return await spawn(self, self.argv(argv), timeout_s, cwd=None, env={}, files=self.system.files)


async def probe(system: System, identity: Identity, workspace: Path, spawner: Spawner) -> None:
    """Run ``true`` the way sandboxes will; raise ``BwrapError`` with bwrap's reason if it fails."""
    sb = BwrapSandbox("probe", workspace, _PROBE_LIMITS, identity, None, spawner, system=system)
    r = await sb.run(["true"], 30)
    if r.exit_code != 0:
        raise BwrapError(
            f"bubblewrap cannot start a sandbox here (exit {r.exit_code}: {r.stderr.strip()}). Unprivileged user "
            "namespaces may be disabled (sysctl kernel.unprivileged_userns_clone=1) or blocked by the container "
            "runtime; fix that, or choose envpool.backend = 'process' (no isolation, development only)"
        )


_PROBE_LIMITS = Limits(
    cpu_seconds=10,
    address_space_bytes=1 << 32,
    max_file_bytes=1 << 20,
    open_files=64,
    processes=1 << 16,
    output_limit_bytes=4096,
    output_kill_bytes=1 << 20,
    tmp_bytes=1 << 20,
    workspace_quota_bytes=1 << 30,
)
