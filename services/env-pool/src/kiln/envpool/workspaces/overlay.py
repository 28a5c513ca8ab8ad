"""Copy-on-write sandbox roots: an environment's read-only layers under one overlayfs
mount per sandbox, the sandbox's own upper directory on top.

A layer is a directory tree whose root stands for the sandbox's ``/`` (the repository
under ``workspace/``, a virtualenv under ``opt/kiln/venv/``, or a whole root file
system). A sandbox's view lives in its own folder: ``upper/`` (its writes), ``work/``
(overlayfs's scratch) and ``root/`` (the merged tree that bubblewrap binds).

The overlay is made with the new mount API (``fsopen``/``fsconfig``/``fsmount``): every
layer, and the sandbox's folder, reach overlayfs as file descriptors of detached mounts
(``open_tree`` clones), so ``/proc/self/mountinfo`` inside the sandbox reads
``lowerdir+=/,...,upperdir=/upper,workdir=/work``: no host path. Kernels before 6.13
(no layers by descriptor) get the classic ``mount(2)`` options instead, which name the
host folders; env-pool logs that once.

Invariants:
- nothing is copied at create: the layers sit read-only beneath (``lowerdir``), the
  sandbox's writes land in ``upper/``, which alone counts against its quota, and a layer
  is never written (overlayfs copies a file up before its first change);
- the sandbox's host uid owns its workspace without a chown walk and without touching
  the layer: the layers it may edit (the repository, the task's own files, a fork's
  frozen state) are reached through idmapped mounts that show their owner (root, who
  built them) as the sandbox's uid; other layers (a virtualenv, a root file system)
  stay root's and read-only to it;
- ``unmount`` undoes every mount of a view (lazily: a process still inside cannot pin
  it); a node that died leaves mounts that ``unmount_below`` removes before its folder
  is deleted.

Needs root (CAP_SYS_ADMIN in the host's namespaces) and a kernel with idmapped mounts
(5.19+ for idmapped overlay layers).
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("kiln.envpool.workspaces.overlay")
_libc = ctypes.CDLL(None, use_errno=True)
# The new mount API: the same numbers on x86_64 and arm64.
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT, _SYS_MOUNT_SETATTR = (
    428,
    429,
    430,
    431,
    432,
    442,
)
_FSOPEN_CLOEXEC, _FSMOUNT_CLOEXEC = 1, 1
_FSCONFIG_SET_FD, _FSCONFIG_CMD_CREATE = 5, 6
_OPEN_TREE_CLONE = 1
_AT_FDCWD, _AT_EMPTY_PATH, _AT_RECURSIVE = -100, 0x1000, 0x8000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_IDMAP = 0x1, 0x00100000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MNT_DETACH = 2
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4


class OverlayError(RuntimeError):
    """An overlay view could not be set up (missing privileges or kernel support)."""


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OverlayError(f"{what}: {os.strerror(err)}")
    return ret


class IdmapNamespaces:
    """User namespaces whose only mapping is ``0 -> uid``, one per host uid, kept open:
    an idmapped mount made with one shows files owned by root as owned by ``uid``."""

    def __init__(self) -> None:
        self._fds: dict[tuple[int, int], int] = {}

    def fd(self, uid: int, gid: int) -> int:
        key = (uid, gid)
        if key not in self._fds:
            self._fds[key] = _userns(uid, gid)
        return self._fds[key]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _userns(uid: int, gid: int) -> int:
    """A user namespace mapping 0 -> (uid, gid), held by an fd (its process is gone)."""
    own = os.readlink("/proc/self/ns/user")
    proc = subprocess.Popen(["unshare", "--user", "sleep", "infinity"], stdin=subprocess.DEVNULL)
    try:
        ns = f"/proc/{proc.pid}/ns/user"
        deadline = time.monotonic() + 10
        while os.readlink(ns) == own:  # unshare(2) has not run yet: a few hundred microseconds
            if proc.poll() is not None or time.monotonic() > deadline:
                raise OverlayError("could not create a user namespace for an idmapped mount")
            time.sleep(0.0005)
        Path(f"/proc/{proc.pid}/uid_map").write_text(f"0 {uid} 1\n")
        Path(f"/proc/{proc.pid}/setgroups").write_text("deny\n")
        Path(f"/proc/{proc.pid}/gid_map").write_text(f"0 {gid} 1\n")
        return os.open(ns, os.O_RDONLY | os.O_CLOEXEC)
    finally:
        proc.kill()
        proc.wait()


def _tree(source: Path, userns_fd: int | None, readonly: bool = True) -> int:
    """A detached clone of ``source`` (read-only, idmapped through ``userns_fd`` if given)."""
    fd = _check(
        _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source), _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE),
        f"open_tree {source}",
    )
    flags = (_MOUNT_ATTR_RDONLY if readonly else 0) | (_MOUNT_ATTR_IDMAP if userns_fd is not None else 0)
    if flags:
        attr = _MountAttr(flags, 0, 0, userns_fd or 0)
        if _libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OverlayError(f"idmapping {source}: {os.strerror(err)}")
    return fd


def _attach(fd: int, target: Path) -> None:
    _check(
        _libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH),
        f"attaching a mount at {target}",
    )


class _LayersByPathOnly(OverlayError):
    """This kernel's overlayfs takes no layers by file descriptor."""


def _overlay_by_fds(lowers: list[int], upper: int, work: int) -> int:
    """A detached overlay mount of ``lowers`` (topmost first) under ``upper``."""
    fs = _check(_libc.syscall(_SYS_FSOPEN, b"overlay", _FSOPEN_CLOEXEC), "fsopen overlay")
    try:
        for key, fd in [*(("lowerdir+", fd) for fd in lowers), ("upperdir", upper), ("workdir", work)]:
            if _libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_FD, key.encode(), None, fd) < 0:
                err = ctypes.get_errno()
                if err == 22 and key == "lowerdir+":  # EINVAL: no "lowerdir+" by descriptor before 6.13
                    raise _LayersByPathOnly(os.strerror(err))
                raise OverlayError(f"overlay {key}: {os.strerror(err)}")
        if _libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0) < 0:
            err = ctypes.get_errno()
            raise OverlayError(f"creating the overlay: {os.strerror(err)} {_fs_log(fs)}".rstrip())
        return _check(_libc.syscall(_SYS_FSMOUNT, fs, _FSMOUNT_CLOEXEC, 0), "fsmount overlay")
    finally:
        os.close(fs)


def _fs_log(fs: int) -> str:
    """The kernel's messages about a failed filesystem context (what overlayfs objected to)."""
    lines = []
    for _ in range(8):
        try:
            lines.append(os.read(fs, 1024).decode(errors="replace").strip())
        except OSError:
            break
    return "; ".join(lines)


_legacy_warned = False


def _umount(target: Path) -> None:
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) < 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point (any more); ENOENT: gone
            raise OverlayError(f"umount {target}: {os.strerror(err)}")


@dataclass(frozen=True)
class LowerLayer:
    path: Path
    owned: bool
    """Shown as the sandbox's own (idmapped root -> its uid): the repository, the task's
    files, a fork's frozen state. Otherwise root's and read-only to the sandbox."""


@dataclass
class OverlayView:
    dir: Path
    layers: tuple[LowerLayer, ...]
    """Lowest first."""
    mounts: list[Path] = field(default_factory=list)
    """Every mount point this view attached, in order (undone in reverse)."""

    @property
    def upper(self) -> Path:
        return self.dir / "upper"

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    def mount(self, uid: int | None, gid: int | None, namespaces: IdmapNamespaces) -> None:
        """Mount the view (the caller made ``dir``; ``upper`` may hold a restored state)."""
        for d in (self.upper, self.dir / "work", self.root):
            d.mkdir(parents=True, exist_ok=True)
        userns = namespaces.fd(uid, gid if gid is not None else uid) if uid is not None else None
        fds: list[int] = []
        try:
            lowers: list[tuple[LowerLayer, int]] = []
            for layer in reversed(self.layers):  # overlayfs takes lower directories topmost first
                lowers.append((layer, _tree(layer.path, userns if layer.owned else None)))
                fds.append(lowers[-1][1])
            folder = _tree(self.dir, None, readonly=False)
            fds.append(folder)
            fds += [os.open(n, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=folder) for n in ("upper", "work")]
            try:
                merged = _overlay_by_fds([fd for _, fd in lowers], fds[-2], fds[-1])
                fds.append(merged)
                _attach(merged, self.root)
                self.mounts.append(self.root)
            except _LayersByPathOnly:
                self._mount_by_paths(lowers)
            if uid is not None:
                os.chown(self.upper, uid, gid if gid is not None else uid)
                ws = self.workspace
                ws.mkdir(exist_ok=True)
                os.chown(ws, uid, gid if gid is not None else uid)
        except BaseException:
            self.unmount()
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def _mount_by_paths(self, lowers: list[tuple[LowerLayer, int]]) -> None:
        """The classic mount(2) for kernels without layers by descriptor: idmapped layers
        are attached under ``dir`` first; the options (visible inside) name host folders."""
        global _legacy_warned
        if not _legacy_warned:
            _legacy_warned = True
            log.warning(
                "this kernel's overlayfs takes no layers by descriptor (6.13+): sandboxes' mountinfo shows host paths"
            )
        paths = []
        for i, (layer, fd) in enumerate(lowers):
            if layer.owned:
                target = self.dir / f"l{i}"
                target.mkdir(exist_ok=True)
                _attach(fd, target)
                self.mounts.append(target)
                paths.append(target)
            else:
                paths.append(layer.path)
        opts = f"lowerdir={':'.join(map(str, paths))},upperdir={self.upper},workdir={self.dir / 'work'}"
        _check(
            _libc.mount(b"overlay", os.fsencode(self.root), b"overlay", 0, opts.encode()),
            f"mount overlay at {self.root}",
        )
        self.mounts.append(self.root)

    def unmount(self) -> None:
        while self.mounts:
            _umount(self.mounts.pop())


def unmount_below(folder: Path) -> int:
    """Detach every mount under ``folder`` (a dead node's views); returns how many."""
    prefix = str(folder.resolve()).rstrip("/") + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split(" ")[4].encode().decode("unicode_escape")
        if point.startswith(prefix):
            points.append(point)
    for point in sorted(points, key=len, reverse=True):
        _umount(Path(point))
    return len(points)


def filesystem_of(path: Path) -> str:
    """The type of the filesystem ``path`` is on (``tmpfs``, ``ext4``, ...), from mountinfo."""
    target, best, kind = str(path.resolve()), "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        point = left.split(" ")[4].encode().decode("unicode_escape")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, right.split(" ")[0]
    return kind


def mount_tmpfs(path: Path) -> None:
    """A tmpfs of its own at ``path`` (a node's workspaces: a bind of a sandbox's folder then
    shows ``/<sandbox>`` in the sandbox's mountinfo, not the node's folder on the host)."""
    _check(
        _libc.mount(b"kiln-workspaces", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0711"),
        f"mount tmpfs at {path}",
    )


def supported() -> str | None:
    """None when overlay views can be made here, else why not."""
    if os.geteuid() != 0:
        return "environment sandboxes need env-pool to run as root (overlayfs and idmapped mounts)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlayfs (modprobe overlay)"
    return None


# --- the upper directory as changes --------------------------------------------------

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
_OPAQUE_XATTR = "trusted.overlay.opaque"


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, _OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def make_whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, 0)


def make_opaque(path: Path) -> None:
    os.setxattr(path, _OPAQUE_XATTR, b"y", follow_symlinks=False)


def copy_upper(src: Path, dst: Path, uid: int = 0, gid: int = 0) -> None:
    """Copy an upper directory (files, links, whiteouts, opaque marks, modes) to ``dst``,
    every entry owned by ``uid``: a fork's frozen layer (root's, idmapped later) or a
    restored upper (the new sandbox's)."""
    dst.mkdir(parents=True, exist_ok=True)
    from kiln.envpool.workspaces.walk import Bounds, walk

    for e in walk(src, Bounds(), []):  # iterative and path-bounded: a tree no host path reaches stays behind
        here = e.here
        out = dst / e.rel
        for name in e.dirs + e.files:
            s, d = here / name, out / name
            st = os.lstat(s)
            if stat.S_ISDIR(st.st_mode):
                d.mkdir(exist_ok=True)
                os.chmod(d, stat.S_IMODE(st.st_mode))
                if is_opaque(s):
                    make_opaque(d)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif is_whiteout(st):
                make_whiteout(d)
            elif stat.S_ISREG(st.st_mode):
                with open(s, "rb") as fin, open(d, "wb") as fout:
                    while chunk := fin.read(1 << 20):
                        fout.write(chunk)
                os.chmod(d, stat.S_IMODE(st.st_mode))
            else:
                continue  # sockets, fifos: not state a sandbox can hand on
            os.chown(d, uid, gid, follow_symlinks=False)
    os.chown(dst, uid, gid)
