"""Structural checks of the services' Dockerfiles and .dockerignore, against the
packages' own dependencies (no Docker engine here): each image copies only the shared
library and its own folder, installs as a non-root user, runs its registered module,
and only the services that run a model carry torch (a CPU build, preinstalled)."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from kiln.shared.registry import discover

ROOT = Path(__file__).resolve().parents[1]
SERVICES_DIR = ROOT / "services"
SERVICE_FOLDERS = sorted(p.name for p in SERVICES_DIR.iterdir() if (p / "pyproject.toml").is_file())
NO_TORCH = ("env-pool", "reward", "weights")
"""Services whose image must not carry torch."""


@pytest.fixture(scope="module")
def registry():
    return discover()


def _dockerfile(folder: str) -> Path:
    return SERVICES_DIR / folder / "Dockerfile"


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with comments dropped and continuations joined."""
    out, buf = [], ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment lines inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, args = buf.strip().partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    if buf.strip():
        instr, _, args = buf.strip().partition(" ")
        out.append((instr.upper(), args.strip()))
    return out


def _exec_form(args: str) -> list[str]:
    args = args.strip()
    if args.startswith("["):
        return list(yaml.safe_load(args))  # a JSON array is YAML
    return shlex.split(args)


def _copy_sources(args: str) -> tuple[list[str], bool]:
    """Sources of a COPY/ADD and whether it copies from another stage or image."""
    words = _exec_form(args)
    flags = [w for w in words if w.startswith("--")]
    paths = [w for w in words if not w.startswith("--")]
    from_stage = any(f.startswith("--from") for f in flags)
    return paths[:-1], from_stage


def _norm(path: str) -> str:
    p = str(PurePosixPath(path.lstrip("/")))
    return "" if p == "." else p


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def _torch_via(folder: str) -> list[tuple[str, Requirement]]:
    """How a service's package pulls torch: ``(chain, torch requirement)`` pairs (empty: it does not)."""
    shared = _pyproject(ROOT / "shared" / "pyproject.toml")
    extras = shared.get("optional-dependencies", {})
    found = []
    for dep in _pyproject(SERVICES_DIR / folder / "pyproject.toml").get("dependencies", []):
        req = Requirement(dep)
        if req.name == "torch":
            found.append((dep, req))
        elif req.name == shared["name"]:
            pulled = [(dep, r) for r in shared.get("dependencies", [])]
            pulled += [(f"{dep} -> [{x}]", r) for x in req.extras for r in extras.get(x, [])]
            found += [(f"{via} -> {r}", Requirement(r)) for via, r in pulled if Requirement(r).name == "torch"]
    return found


@pytest.mark.parametrize("folder", SERVICE_FOLDERS)
def test_dockerfile_copies_only_shared_and_its_own_folder(folder):
    path = _dockerfile(folder)
    assert path.is_file(), f"services/{folder}/Dockerfile does not exist"
    own = f"services/{folder}"
    copied = []
    for instr, args in _instructions(path):
        if instr not in ("COPY", "ADD"):
            continue
        sources, from_stage = _copy_sources(args)
        if from_stage:
            continue  # from another build stage, not from the build context
        for src in sources:
            n = _norm(src)
            ok = n == "shared" or n.startswith("shared/") or n == own or n.startswith(own + "/")
            assert ok, (
                f"services/{folder}/Dockerfile: `{instr} {args}` copies {src!r} from the build context; "
                f"only shared/ and {own}/ may be copied"
            )
            copied.append(n)
    assert any(n == "shared" or n.startswith("shared/") for n in copied), (
        f"services/{folder}/Dockerfile never copies shared/"
    )
    assert any(n == own or n.startswith(own + "/") for n in copied), f"services/{folder}/Dockerfile never copies {own}/"


@pytest.mark.parametrize("folder", SERVICE_FOLDERS)
def test_dockerfile_base_install_user_and_command(folder, registry):
    path = _dockerfile(folder)
    instrs = _instructions(path)
    froms = [a for i, a in instrs if i == "FROM"]
    assert froms and froms[0].split()[0] == "python:3.11-slim", (
        f"services/{folder}/Dockerfile starts FROM {froms[0] if froms else 'nothing'!r}, expected python:3.11-slim"
    )
    installs = [a for i, a in instrs if i == "RUN" and "pip install" in a]
    words = [w.rstrip("/") for a in installs for w in shlex.split(a)]
    assert any(PurePosixPath(w).name == "shared" for w in words), (
        f"services/{folder}/Dockerfile: no `pip install` of ./shared"
    )
    assert any(w.endswith(f"services/{folder}") for w in words), (
        f"services/{folder}/Dockerfile: no `pip install` of ./services/{folder}"
    )
    users = [a.split(":")[0] for i, a in instrs if i == "USER"]
    assert users and users[-1] not in ("root", "0"), (
        f"services/{folder}/Dockerfile runs as root: add a non-root USER after the installs"
    )
    cmds = [a for i, a in instrs if i == "CMD"]
    module = registry[folder].module
    assert cmds and _exec_form(cmds[-1]) == ["python", "-m", module], (
        f"services/{folder}/Dockerfile: CMD is {cmds[-1] if cmds else 'missing'}, expected "
        f'["python", "-m", "{module}"] (the module registered for {folder!r})'
    )


@pytest.mark.parametrize("folder", NO_TORCH)
def test_torch_free_services_do_not_pull_torch(folder):
    why = [chain for chain, _ in _torch_via(folder)]
    assert not why, f"services/{folder}/pyproject.toml pulls torch through {why}; {folder} must stay torch-free"
    for instr, args in _instructions(_dockerfile(folder)):
        assert "torch" not in args.lower(), (
            f"services/{folder}/Dockerfile mentions torch in `{instr} {args}`; {folder}'s image must stay torch-free"
        )


@pytest.mark.parametrize("folder", [f for f in SERVICE_FOLDERS if f not in NO_TORCH])
def test_torch_services_preinstall_a_cpu_torch_their_packages_accept(folder):
    why = _torch_via(folder)
    if not why:
        pytest.skip(f"{folder} does not depend on torch")
    instrs = _instructions(_dockerfile(folder))
    runs = [a for i, a in instrs if i == "RUN"]
    torch_runs = [n for n, a in enumerate(runs) if re.search(r"pip install .*\btorch==", a)]
    kiln_runs = [n for n, a in enumerate(runs) if "pip install" in a and f"services/{folder}" in a]
    assert torch_runs, (
        f"services/{folder}/Dockerfile does not pin torch (`pip install torch==X --index-url .../whl/cpu`)"
    )
    assert kiln_runs and torch_runs[0] < kiln_runs[0], (
        f"services/{folder}/Dockerfile must install torch before the kiln packages, or pip pulls the CUDA build from PyPI"
    )
    line = runs[torch_runs[0]]
    assert re.search(r"--(extra-)?index-url\s+\S+/whl/cpu\b", line), (
        f"services/{folder}/Dockerfile installs torch without the PyTorch CPU index: `{line}`"
    )
    pinned = Version(re.search(r"\btorch==([\w.+]+)", line).group(1))
    for chain, req in why:
        assert req.specifier.contains(pinned, prereleases=True), (
            f"services/{folder}/Dockerfile pins torch {pinned}, but {chain} does not accept it"
        )


def test_dockerignore_keeps_local_state_out_of_the_context():
    path = ROOT / ".dockerignore"
    assert path.is_file(), ".dockerignore is missing: .venv and runs/ would be sent as build context"
    patterns = {
        line.strip().rstrip("/") for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
    }
    for want in (".venv", "runs", ".git", "**/__pycache__", "**/*.egg-info"):
        assert want in patterns, f".dockerignore does not exclude {want!r} (patterns: {sorted(patterns)})"
