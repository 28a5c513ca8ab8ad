"""Building layers. Everything is written into ``<digest>.partial-<pid>-<n>`` folders and
renamed into place when complete: a crash leaves no half layer that looks built.

The python layer and setup commands run in a bubblewrap *build sandbox* that binds the
layers at their final paths (the repository at ``/workspace``, the venv at
``/opt/kiln/venv``, the base's root filesystem as ``/`` or the host's ``/usr``), with the
network on, so shebangs, ``pyvenv.cfg`` and editable-install ``.pth`` files name the
paths the sandboxes will see.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

from kiln.envpool.isolation.bwrap import host_system_binds
from kiln.shared.environments import VENV, WORKSPACE, DebianBase, EnvironmentSpec, OciBase

from .layers import EnvironmentBuildError, LayerPlan
from .unpack import UnpackError, materialize_repository, unpack_oci

HOST_RO_BINDS = (
    "/usr",
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ssl",
    "/etc/localtime",
    "/etc/ca-certificates",
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
)
"""Host paths the build sandbox of a host-base environment binds read-only (missing ones skipped)."""
ROOTFS_DIRS = ("workspace", "opt/kiln", "tmp", "proc", "dev")
"""Folders a debian/oci base layer gets (mount points of the sandboxes)."""
ROOTFS_FILES = ("etc/resolv.conf", "etc/hosts")
"""Files a debian/oci base layer gets (the build binds the host's over them, for the network)."""
UV_IN_SANDBOX = "/opt/kiln/tools/uv"
NODE_IN_SANDBOX = "/opt/kiln/.node"
"""Where a python build sees the cache root: the uv cache and the venv being built must be
in one mount for uv to hard-link (Linux refuses links between two bind mounts), so the
build binds the root once (its ``layers``, ``envs`` and ``locks`` read-only over it) and
``/opt/kiln/venv`` is a symlink into ``build/<partial>``. Nothing built records the
symlink's target: the venv is relocatable and Python reports ``/opt/kiln/venv``."""
CA_IN_SANDBOX = "/opt/kiln/tools/ca-certificates.crt"


def host_ca_bundle() -> str | None:
    """The node's CA bundle (a proxy's CA included), bound into builds so uv trusts what the
    node trusts, whatever the base holds."""
    for k in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE"):
        if os.environ.get(k) and os.path.isfile(os.environ[k]):
            return os.environ[k]
    for p in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt"):
        if os.path.isfile(p):
            return p
    return None


BUILD_TIMEOUT_S = 3600
_seq = itertools.count()


def partial_path(final: Path) -> Path:
    return final.with_name(f"{final.name}.partial-{os.getpid()}-{next(_seq)}")


def publish(partial: Path, final: Path) -> None:
    """Rename a finished partial into place (another process may have won the race)."""
    try:
        os.rename(partial, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(partial, ignore_errors=True)


def find_uv() -> str:
    """The uv binary: next to this Python (the venv's ``bin``), else on PATH."""
    import sys

    for cand in (Path(sys.executable).parent / "uv", shutil.which("uv")):
        if cand and Path(cand).is_file():
            return str(Path(cand).resolve())
    try:  # the `uv` wheel knows where its binary is
        from uv import find_uv_bin  # type: ignore[import-not-found]

        return find_uv_bin()
    except Exception:  # noqa: BLE001
        raise FileNotFoundError("uv is not installed (pip install uv)") from None


def _tail(text: str, n: int = 3000) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


class BuildSandbox:
    """``bwrap`` argv for one build: the base, the layers at their final paths, the network."""

    def __init__(
        self,
        rootfs: Path | None,
        node_root: Path | None,
        workspace: Path | None,
        venv: Path | None,
        writable_workspace: bool,
        network: bool = True,
    ):
        """``node_root``: the cache root, for uv (its cache, hard links into ``venv``, which
        must then lie under ``node_root/build``); None: no uv cache (setup commands)."""
        self.rootfs, self.node_root, self.workspace, self.venv = rootfs, node_root, workspace, venv
        self.writable_workspace, self.network = writable_workspace, network

    def argv(self, command: list[str], env: dict[str, str]) -> list[str]:
        a = ["bwrap", "--die-with-parent", "--unshare-all", "--hostname", "kiln-build"]
        if self.network:
            a.append("--share-net")
        if self.rootfs is None:
            a += host_system_binds(HOST_RO_BINDS)
        else:
            a += ["--ro-bind", str(self.rootfs), "/"]
            for f in ("/etc/resolv.conf", "/etc/hosts"):
                if self.network and os.path.exists(f) and (self.rootfs / f[1:]).exists():
                    a += ["--ro-bind", f, f]
        a += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            "--tmpfs",
            "/opt/kiln",
            "--ro-bind",
            find_uv(),
            UV_IN_SANDBOX,
        ]
        if ca := host_ca_bundle():
            a += ["--ro-bind", ca, CA_IN_SANDBOX]
        if self.node_root is not None:
            a += ["--bind", str(self.node_root), NODE_IN_SANDBOX]
            for d in ("layers", "envs", "locks"):
                if (self.node_root / d).is_dir():
                    a += ["--ro-bind", str(self.node_root / d), f"{NODE_IN_SANDBOX}/{d}"]
            if self.venv is not None:
                rel = self.venv.relative_to(self.node_root)
                a += ["--symlink", f"{NODE_IN_SANDBOX}/{rel}", VENV]
        elif self.venv is not None:
            a += ["--bind", str(self.venv), VENV]
        if self.workspace is not None:
            a += ["--bind" if self.writable_workspace else "--ro-bind", str(self.workspace), WORKSPACE]
        else:
            a += ["--dir", WORKSPACE]
        a += ["--chdir", WORKSPACE, "--clearenv"]
        for k, v in env.items():
            a += ["--setenv", k, v]
        return a + ["--", *command]


def sandbox_env(python: bool, uv_cache: bool = True) -> dict[str, str]:
    path = "/opt/kiln/tools:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env = {
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "PATH": (f"{VENV}/bin:" if python else "") + path,
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_NO_PROGRESS": "1",
    }
    if uv_cache:
        env.update(UV_CACHE_DIR=f"{NODE_IN_SANDBOX}/uv-cache", UV_LINK_MODE="hardlink")
    else:
        env["UV_NO_CACHE"] = "1"
    if host_ca_bundle():
        env.update(SSL_CERT_FILE=CA_IN_SANDBOX, UV_NATIVE_TLS="1")
    if python:
        env["VIRTUAL_ENV"] = VENV
    for k, v in os.environ.items():  # index and proxy settings of the node
        if k.startswith("UV_INDEX") or k in (
            "UV_DEFAULT_INDEX",
            "UV_EXTRA_INDEX_URL",
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "http_proxy",
            "https_proxy",
            "NO_PROXY",
            "no_proxy",
        ):
            env[k] = v
    if os.environ.get("PIP_INDEX_URL") and "UV_DEFAULT_INDEX" not in env and "UV_INDEX_URL" not in env:
        env["UV_DEFAULT_INDEX"] = os.environ["PIP_INDEX_URL"]
    return env


def run_in(sandbox: BuildSandbox, env_name: str, step: str, command: list[str], python: bool) -> str:
    argv = sandbox.argv(command, sandbox_env(python, sandbox.node_root is not None))
    try:
        out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise EnvironmentBuildError(env_name, step, f"timed out after {BUILD_TIMEOUT_S}s: {' '.join(command)}") from e
    if out.returncode:
        raise EnvironmentBuildError(
            env_name, step, f"`{' '.join(command)}` exited {out.returncode}:\n{_tail(out.stdout)}"
        )
    return out.stdout


# -- steps ----------------------------------------------------------------------------------


def build_base(spec: EnvironmentSpec, dest: Path) -> None:
    """A debian or oci root filesystem into ``dest`` (a partial folder)."""
    base = spec.base
    if isinstance(base, OciBase):
        try:
            unpack_oci(Path(base.archive), dest)
        except UnpackError as e:
            raise EnvironmentBuildError(spec.name, "base", str(e)) from e
    elif isinstance(base, DebianBase):
        mmdebstrap = shutil.which("mmdebstrap") or _install_mmdebstrap(spec.name)
        cmd = [mmdebstrap, "--variant=minbase", "--mode=auto", "--quiet"]
        if base.packages:
            cmd.append("--include=" + ",".join(base.packages))
        cmd += [base.suite, str(dest)] + ([base.mirror] if base.mirror else [])
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=BUILD_TIMEOUT_S)
        if out.returncode:
            raise EnvironmentBuildError(spec.name, "base", f"mmdebstrap exited {out.returncode}:\n{_tail(out.stdout)}")
    for d in ROOTFS_DIRS:
        p = dest / d
        if p.is_symlink():
            p.unlink()
        p.mkdir(parents=True, exist_ok=True)
    (dest / "tmp").chmod(0o1777)
    for f in ROOTFS_FILES:
        p = dest / f
        if not p.exists() and not p.is_symlink():
            p.parent.mkdir(parents=True, exist_ok=True)
            p.touch()
        elif p.is_symlink():  # e.g. resolv.conf -> ../run/...: a bind target must be a file
            p.unlink()
            p.touch()


def _install_mmdebstrap(env_name: str) -> str:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise EnvironmentBuildError(env_name, "base", "mmdebstrap is not installed (apt-get install mmdebstrap)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    out = subprocess.run(["apt-get", "install", "-y", "-q", "mmdebstrap"], capture_output=True, text=True, env=env)
    if out.returncode:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)
        out = subprocess.run(["apt-get", "install", "-y", "-q", "mmdebstrap"], capture_output=True, text=True, env=env)
    path = shutil.which("mmdebstrap")
    if out.returncode or not path:
        raise EnvironmentBuildError(env_name, "base", f"installing mmdebstrap failed:\n{_tail(out.stderr)}")
    return path


def build_repository(spec: EnvironmentSpec, layer: Path) -> None:
    try:
        materialize_repository(spec.repository, layer / WORKSPACE.lstrip("/"))
    except (UnpackError, OSError) as e:
        raise EnvironmentBuildError(spec.name, "repository", str(e)) from e


def build_python(spec: EnvironmentSpec, sandbox: BuildSandbox) -> None:
    py = spec.python
    assert py is not None
    uv = UV_IN_SANDBOX
    run_in(
        sandbox,
        spec.name,
        "python",
        [
            uv,
            "venv",
            "--quiet",
            "--relocatable",
            "--allow-existing",
            "--python-preference",
            "only-system",
            "--python",
            py.interpreter,
            VENV,
        ],
        python=False,
    )
    args: list[str] = []
    for req in py.requirements_files:
        args += ["-r", f"{WORKSPACE}/{req}"]
    if py.install_project:
        extras = f"[{','.join(py.extras)}]" if py.extras else ""
        args += ["-e", f"{WORKSPACE}{extras}"]
    args += py.packages
    if args:
        # One resolution for everything: the editable project satisfies every requirement
        # on its own name (pytest's on iniconfig or pluggy, a plugin's on its host), so no
        # copy of it comes from the index to shadow the repository's files.
        era = ["--exclude-newer", py.exclude_newer] if py.exclude_newer else []
        run_in(
            sandbox,
            spec.name,
            "python",
            [uv, "pip", "install", "--python", f"{VENV}/bin/python", *era, *args],
            python=True,
        )
        if py.install_project:
            framework_copies(spec, sandbox, era)


FRAMEWORK_DIR = f"{VENV}/kiln-framework"
"""Pristine copies of distributions the test framework needs that the editable project
provides (pytest needs iniconfig and pluggy): kiln's runner imports the framework with the
workspace on no path, so the framework never runs the repository's code."""
_FRAMEWORK_PROBE = r"""
import importlib.metadata, json, os, sys
inside = [p for p in sys.path if (os.path.abspath(p) + "/").startswith("/workspace/")]
sys.path[:] = [p for p in sys.path if p not in inside]
try:
    import pytest  # noqa: F401
    missing = None
except ModuleNotFoundError as e:
    missing = (e.name or "").partition(".")[0]
sys.path[:] = sys.path + inside
dists = importlib.metadata.packages_distributions().get(missing, []) if missing and missing != "pytest" else []
print(json.dumps(dists))
"""


def framework_copies(spec: EnvironmentSpec, sandbox: BuildSandbox, era: list[str]) -> None:
    """When the framework cannot be imported without the workspace (the repository is one
    of its dependencies), install that distribution's release as of the era into
    ``FRAMEWORK_DIR``, on the venv's path after the editable project's folders: where the
    workspace is on the path its files come first, where it is not the framework finds its
    own copy."""
    import json

    python = f"{VENV}/bin/python"
    for _ in range(8):  # a chain: each round finds one more distribution
        dists = json.loads(
            run_in(sandbox, spec.name, "python", [python, "-I", "-c", _FRAMEWORK_PROBE], python=True)
            .strip()
            .splitlines()[-1]
        )
        if not dists:
            return
        run_in(
            sandbox,
            spec.name,
            "python",
            [UV_IN_SANDBOX, "pip", "install", "--python", python, "--target", FRAMEWORK_DIR, "--no-deps", *era, *dists],
            python=True,
        )
        run_in(
            sandbox,
            spec.name,
            "python",
            [
                python,
                "-c",
                "import site; open(site.getsitepackages()[0] + '/zzz-kiln-framework.pth', 'w')"
                f".write({FRAMEWORK_DIR!r} + '\\n')",
            ],
            python=True,
        )


def run_setup(spec: EnvironmentSpec, sandbox: BuildSandbox) -> None:
    for cmd in spec.setup:
        run_in(sandbox, spec.name, "setup", ["/bin/sh", "-ec", cmd], python=spec.python is not None)


def build_layers(plan: LayerPlan, root: Path, missing: set[str]) -> None:
    """Build the layers in ``missing`` (digests) of ``plan`` under ``root/layers``; the
    layers not missing are present."""
    spec, layers = plan.spec, root / "layers"
    (root / "uv-cache").mkdir(parents=True, exist_ok=True)
    (root / "build").mkdir(parents=True, exist_ok=True)
    partials: list[tuple[Path, Path]] = []
    try:
        if plan.base and plan.base in missing:
            p = partial_path(layers / plan.base)
            partials.append((p, layers / plan.base))
            build_base(spec, p)
            publish(*partials.pop())
        rootfs = layers / plan.base if plan.base else None

        def fresh(digest: str, where: Path = layers) -> Path:
            p = partial_path(where / digest)
            p.mkdir(parents=True)
            partials.append((p, layers / digest))
            return p

        need_repo = plan.repository in missing
        need_py = plan.python is not None and plan.python in missing
        if plan.coupled and (need_repo or need_py):
            repo = fresh(plan.repository)
            build_repository(spec, repo)
            venv = None
            if plan.python:
                venv = fresh(plan.python, root / "build") / VENV.lstrip("/")
                venv.mkdir(parents=True)
            if spec.python:
                build_python(spec, BuildSandbox(rootfs, root, repo / "workspace", venv, writable_workspace=True))
            # setup sees the venv bound directly, not the node's root: its files are hard links
            # into uv's cache, which setup commands must not reach
            run_setup(spec, BuildSandbox(rootfs, None, repo / "workspace", venv, writable_workspace=True))
        else:
            if need_repo:
                build_repository(spec, fresh(plan.repository))
            if need_py:
                venv = fresh(plan.python, root / "build") / VENV.lstrip("/")  # type: ignore[arg-type]
                venv.mkdir(parents=True)
                build_python(spec, BuildSandbox(rootfs, root, None, venv, writable_workspace=False))
        for partial, final in partials:
            if final.is_dir():  # built beside one present (coupled layers): keep the present one
                shutil.rmtree(partial, ignore_errors=True)
            else:
                publish(partial, final)
        partials.clear()
    finally:
        for partial, _ in partials:
            shutil.rmtree(partial, ignore_errors=True)
