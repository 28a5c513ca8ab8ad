"""Running a command in a built environment with plain read-only binds (no overlay): for
checks, ``kiln env build --check`` style tools and tests. env-pool's sandboxes mount the
layers with overlayfs instead (a writable upper over them)."""

from __future__ import annotations

from pathlib import Path

from kiln.envpool.isolation.bwrap import host_system_binds
from kiln.shared.environments import VENV, WORKSPACE

from .builder import HOST_RO_BINDS
from .layers import BuiltEnvironment


def environment_bwrap_args(
    built: BuiltEnvironment,
    command: list[str],
    *,
    network: bool = False,
    workspace: Path | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    """``bwrap`` argv running ``command`` in ``built``: its base (the host's ``/usr`` or the
    root filesystem as ``/``), the venv at ``/opt/kiln/venv`` and the repository at
    ``/workspace`` read-only (``workspace``: a writable folder bound there instead)."""
    a = ["bwrap", "--die-with-parent", "--unshare-all", "--hostname", "kiln"]
    if network:
        a.append("--share-net")
    base = built.layer("base")
    if base is None:
        a += host_system_binds(HOST_RO_BINDS)
    else:
        a += ["--ro-bind", str(base.path), "/"]
    a += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/opt/kiln"]
    py = built.layer("python")
    if py is not None:
        a += ["--ro-bind", str(py.path / VENV.lstrip("/")), VENV]
    repo = built.layer("repository")
    if workspace is not None:
        a += ["--bind", str(workspace), WORKSPACE]
    elif repo is not None:
        a += ["--ro-bind", str(repo.path / WORKSPACE.lstrip("/")), WORKSPACE]
    path = ":".join([*built.path, "/usr/local/bin", "/usr/bin", "/bin"])
    full = {"HOME": "/tmp", "LANG": "C.UTF-8", "PATH": path, "PYTHONDONTWRITEBYTECODE": "1", **built.env, **(env or {})}
    a += ["--chdir", WORKSPACE, "--clearenv"]
    for k, v in full.items():
        a += ["--setenv", k, v]
    return a + ["--", *command]
