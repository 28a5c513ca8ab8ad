"""What a built environment is: its layers, their digests, and its manifest on disk."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln.shared.environments import VENV, EnvironmentSpec, HostBase, PythonSpec, sha256_json


@dataclass(frozen=True)
class Layer:
    name: str
    """``base`` | ``python`` | ``repository``."""
    digest: str
    """Content digest of the layer (hex sha256); its folder is ``<root>/layers/<digest>``."""
    path: Path
    """Read-only tree whose root stands for the sandbox's ``/`` (``<path>/workspace/...``,
    ``<path>/opt/kiln/venv/...``, or a whole root filesystem for a debian/oci base)."""


@dataclass(frozen=True)
class BuiltEnvironment:
    name: str
    """The spec's name (the first name a digest was built under is not remembered)."""
    digest: str
    """``EnvironmentSpec.digest``."""
    host_base: bool
    """True: the sandbox uses the host's ``/usr`` etc. and the layers hold only
    ``/workspace`` and ``/opt/kiln``."""
    layers: tuple[Layer, ...]
    """Lowest first: base root filesystem (when not host_base), python, repository."""
    path: tuple[str, ...] = ()
    """PATH entries inside the sandbox before the system ones."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables inside the sandbox."""
    size_bytes: int = 0
    """Bytes of the environment's layers on disk (shared layers counted in full)."""

    def layer(self, name: str) -> Layer | None:
        return next((layer for layer in self.layers if layer.name == name), None)

    def to_json(self) -> dict:
        d = asdict(self)
        d["layers"] = [{"name": la.name, "digest": la.digest, "path": str(la.path)} for la in self.layers]
        return d

    @classmethod
    def from_json(cls, d: dict) -> BuiltEnvironment:
        layers = tuple(Layer(x["name"], x["digest"], Path(x["path"])) for x in d["layers"])
        return cls(d["name"], d["digest"], d["host_base"], layers, tuple(d["path"]), dict(d["env"]), d["size_bytes"])


class EnvironmentBuildError(RuntimeError):
    """A build failed: names the environment, the step (``base``, ``repository``,
    ``python``, ``setup``, ``store``) and the reason (the tool's output tail)."""

    def __init__(self, environment: str, step: str, reason: str):
        self.environment, self.step, self.reason = environment, step, reason.strip()
        super().__init__(f"environment {environment!r}: {step} step failed: {self.reason}")


@dataclass(frozen=True)
class LayerPlan:
    """The layers an environment needs, with their digests (before anything is built)."""

    spec: EnvironmentSpec
    digest: str
    base: str | None
    python: str | None
    repository: str
    coupled: bool
    """python and repository (and setup) are built together: the python build reads or
    writes the repository (editable install, requirements files) or setup runs."""


def plan_layers(spec: EnvironmentSpec, inputs: dict[str, str]) -> LayerPlan:
    """Layer digests. A layer's digest covers everything it is built from, so layers are
    shared between environments whenever that is sound (one base under many venvs)."""
    base = (
        None if isinstance(spec.base, HostBase) else sha256_json(["base", spec.canonical()["base"], inputs.get("base")])
    )
    repo_dump = spec.canonical()["repository"]
    repo_plain = sha256_json(["repository", repo_dump, inputs.get("repository")])
    py: PythonSpec | None = spec.python
    coupled = bool(spec.setup) or bool(py and (py.install_project or py.requirements_files))
    if not coupled:
        python = None if py is None else sha256_json(["python", base, py.model_dump(mode="json")])
        return LayerPlan(spec, spec.digest(inputs), base, python, repo_plain, False)
    whole = [base, None if py is None else py.model_dump(mode="json"), repo_plain, spec.setup]
    python = None if py is None else sha256_json(["python+repository", "python", whole])
    repository = sha256_json(["python+repository", "repository", whole])
    return LayerPlan(spec, spec.digest(inputs), base, python, repository, True)


def environment_from_plan(plan: LayerPlan, root: Path, sizes: dict[str, int]) -> BuiltEnvironment:
    layers = []
    if plan.base:
        layers.append(Layer("base", plan.base, root / "layers" / plan.base))
    if plan.python:
        layers.append(Layer("python", plan.python, root / "layers" / plan.python))
    layers.append(Layer("repository", plan.repository, root / "layers" / plan.repository))
    path = (f"{VENV}/bin",) if plan.python else ()
    env = {"VIRTUAL_ENV": VENV} if plan.python else {}
    size = sum(sizes.get(la.digest, 0) for la in layers)
    return BuiltEnvironment(plan.spec.name, plan.digest, plan.base is None, tuple(layers), path, env, size)


def tree_size(path: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for n in filenames + dirnames:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            total += st.st_blocks * 512 if st.st_nlink == 1 else st.st_size // max(st.st_nlink, 1)
    return total


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
