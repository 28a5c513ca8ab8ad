"""The bubblewrap backend: every command in its own set of Linux namespaces.

Each ``run`` starts ``bwrap`` with: all namespaces unshared (user, pid, ipc, uts, net:
only a loopback of its own, so no host service, NATS included, is reachable), a
cleared environment, ``--die-with-parent`` and ``--new-session``, the system
(``/usr`` and a short list of ``/etc`` files) mounted read-only, a synthetic
``/etc/passwd``, a read-only root, a private size-limited tmpfs at ``/tmp``, and the
workspace as the only writable host path, at ``/workspace``. Inside it runs as uid/gid 1000; on the
host, when env-pool is root, as the sandbox's own unprivileged uid (see
``Identity``), so even a sandbox escape lands in an account that owns nothing but
its workspace. The pid namespace dies with the command: nothing survives a ``run``.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

from kiln.shared.bus import ServiceError
from kiln.shared.contracts import ExecResult

from kiln.envpool.launcher import Launcher
from kiln.envpool.sandbox import SANDBOX_PATH, Identity, Limits, Sandbox, spawn

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


def system_args(ro_binds: list[str], etc_dir: Path) -> list[str]:
    """The read-only system every sandbox sees (computed once per node)."""
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
    args += ["--ro-bind", str(etc_dir / "passwd"), "/etc/passwd", "--ro-bind", str(etc_dir / "group"), "/etc/group"]
    return args


def write_identity_files(etc_dir: Path) -> None:
    etc_dir.mkdir(parents=True, exist_ok=True)
    (etc_dir / "passwd").write_text(f"root:x:0:0::/:/usr/sbin/nologin\nsandbox:x:{INNER_UID}:{INNER_UID}::/workspace:/bin/bash\n")
    (etc_dir / "group").write_text(f"root:x:0:\nsandbox:x:{INNER_UID}:\n")
    for f in (etc_dir, etc_dir / "passwd", etc_dir / "group"):
        os.chmod(f, 0o755 if f.is_dir() else 0o644)


class BwrapSandbox(Sandbox):
    def __init__(self, *args, system: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.system = system
        self.sources = [system[i + 1] for i, a in enumerate(system) if a == "--ro-bind"] + [str(self.workspace)]

    def argv(self, argv: list[str]) -> list[str]:
        return [
            bwrap_binary(),
            "--unshare-all",
            "--unshare-user",
            "--uid", str(INNER_UID),
            "--gid", str(INNER_UID),
            "--hostname", "sandbox",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--setenv", "PATH", SANDBOX_PATH,
            "--setenv", "HOME", "/workspace",
            "--setenv", "TMPDIR", "/tmp",
            "--setenv", "LANG", "C.UTF-8",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--setenv", "PYTHONUNBUFFERED", "1",
            *self.system,
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", str(self.limits.tmp_bytes), "--tmpfs", "/tmp",
            "--bind", str(self.workspace), "/workspace",
            "--remount-ro", "/",  # the root bwrap builds is a tmpfs: writable unless we say so
            "--chdir", "/workspace",
            "--",
            *argv,
        ]  # fmt: skip

    async def run(self, argv: list[str], timeout_s: float) -> ExecResult:
        # bwrap exits before the command starts when a path it binds is gone (this node's
        # files removed under it): a broken node, not the command's result, so it must not
        # reach a caller (a reward harness) as a failing command.
        missing = [p for p in self.sources if not os.path.exists(p)]
        if missing:
            raise ServiceError(f"sandbox {self.id} cannot start: {', '.join(missing)} no longer exist on this node", "sandbox_broken")
        return await spawn(self, self.argv(argv), timeout_s, cwd=None, env={})


async def probe(system: list[str], identity: Identity, workspace: Path, launcher: Launcher) -> None:
    """Run ``true`` the way sandboxes will; raise ``BwrapError`` with bwrap's reason if it fails."""
    sb = BwrapSandbox("probe", workspace, _PROBE_LIMITS, identity, None, launcher, system=system)
    r = await sb.run(["true"], 30)
    if r.exit_code != 0:
        raise BwrapError(
            f"bubblewrap cannot start a sandbox here (exit {r.exit_code}: {r.stderr.strip()}). Unprivileged user "
            "namespaces may be disabled (sysctl kernel.unprivileged_userns_clone=1) or blocked by the container "
            "runtime; fix that, or choose envpool.backend = 'process' (no isolation, development only)"
        )


_PROBE_LIMITS = Limits(
    cpu_seconds=10, address_space_bytes=1 << 32, max_file_bytes=1 << 20, open_files=64, processes=1 << 16,
    output_limit_bytes=4096, output_kill_bytes=1 << 20, tmp_bytes=1 << 20, workspace_quota_bytes=1 << 30,
)
