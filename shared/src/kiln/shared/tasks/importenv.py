"""The environment of an imported instance (``kiln tasks import``), inferred so nobody has
to write it by hand: the repository at the instance's commit declares its test
requirements (``kiln.shared.tasks.testdeps``, the same reading ``kiln tasks synth`` does),
and they are resolved as of the instance's era (uv's ``--exclude-newer``: its
``created_at``, else its commit's date), so a 2024 suite gets a 2024 pytest.

Invariants:
- an installable repository is installed editable, in the same resolution as its test
  requirements: a requirement on its own distribution (pytest's on iniconfig or pluggy)
  is met by the repository's files, never by a copy from the index; a repository that
  cannot be installed but keeps its modules under ``src/`` gets that folder on the venv's
  path instead (a ``.pth`` written by a setup command);
- ``--env-specs`` tables override what is inferred key by key (a key given replaces the
  inferred value; ``extra_packages`` adds to it); unknown keys are errors.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln.shared.environments import PythonSpec
from kiln.shared.tasks.testdeps import Tree, is_installable, own_modules, test_dependencies

DEFAULT_INTERPRETER = PythonSpec.model_fields["interpreter"].default
ENV_SPEC_KEYS = {
    "interpreter",
    "python",
    "install_project",
    "extras",
    "requirements_files",
    "packages",
    "pip_packages",
    "extra_packages",
    "exclude_newer",
    "setup",
}
ERAS = ("auto", "commit", "none")
"""``--exclude-newer`` modes besides a date: ``auto`` (``created_at``, else the commit's
date), ``commit`` (the commit's date), ``none`` (the newest releases)."""
SRC_PTH = (
    "python -c \"import site; open(site.getsitepackages()[0] + '/kiln-workspace-src.pth', 'w')"
    ".write('/workspace/src\\n')\""
)
"""The setup command that puts a non-installable repository's ``src/`` on the venv's path."""


def load_env_specs(path: str | Path) -> dict[str, dict[str, Any]]:
    """``--env-specs FILE.toml``: tables keyed ``"owner/name@version"`` or ``"owner/name"``
    (``ENV_SPEC_KEYS``; docs/tasks.md)."""
    data = tomllib.loads(Path(path).read_text())
    for key, spec in data.items():
        if not isinstance(spec, dict):
            raise ValueError(f"{path}: [{key!r}] must be a table")
        if unknown := set(spec) - ENV_SPEC_KEYS:
            raise ValueError(f"{path}: [{key!r}] has unknown keys {sorted(unknown)} (known: {sorted(ENV_SPEC_KEYS)})")
        if isinstance(spec.get("exclude_newer"), str) and spec["exclude_newer"] != "none":
            PythonSpec(exclude_newer=spec["exclude_newer"])  # a clear error now, not at build time
    return data


def override(inferred: PythonSpec, setup: list[str], t: dict[str, Any]) -> tuple[PythonSpec, list[str]]:
    """An ``--env-specs`` table over the inferred spec: each key given replaces the inferred
    value (``packages``/``pip_packages`` together), ``extra_packages`` adds to them."""
    fields = inferred.model_dump()
    if t.get("interpreter") or t.get("python"):
        fields["interpreter"] = t.get("interpreter") or f"python{t['python']}"
    for key in ("install_project", "extras", "requirements_files"):
        if key in t:
            fields[key] = t[key] if key != "install_project" else bool(t[key])
    if "packages" in t or "pip_packages" in t:
        fields["packages"] = [*t.get("packages", []), *t.get("pip_packages", [])]
    fields["packages"] = [*fields["packages"], *t.get("extra_packages", [])]
    if "exclude_newer" in t:
        fields["exclude_newer"] = None if t["exclude_newer"] in ("none", "", None) else t["exclude_newer"]
    return PythonSpec.model_validate(fields), list(t["setup"]) if "setup" in t else setup


def _requirement_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else ""


def inferred_python(
    tree: Tree, interpreter: str, runner: str, exclude_newer: str | None
) -> tuple[PythonSpec, list[str], str]:
    """(python spec, setup commands, where the test requirements came from) for the
    repository ``tree``: the project editable when installable, its test requirements,
    pytest when the tests run with it."""
    deps = test_dependencies(tree)
    packages = list(deps.packages)
    if runner == "pytest" and "pytest" not in {_requirement_name(p) for p in packages}:
        packages.append("pytest")
    installable = is_installable(tree)
    setup = []
    if not installable and any(f.startswith("src/") and f.endswith(".py") for f in tree.files()) and own_modules(tree):
        setup = [SRC_PTH]
    spec = PythonSpec(
        interpreter=interpreter,
        install_project=installable,
        extras=deps.extras if installable else [],
        requirements_files=deps.requirements_files,
        packages=packages,
        exclude_newer=exclude_newer,
    )
    return spec, setup, deps.source or "nothing declared"


# -- the instance's era -------------------------------------------------------------------------


def moment(value: Any) -> str | None:
    """A ``created_at`` as uv's UTC timestamp (``2023-01-07T11:08:11Z``): ISO text (``Z``,
    an offset or none: UTC), or seconds / milliseconds since the epoch (exports of
    parquet timestamps); None when it is none of those."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        when = datetime.fromtimestamp(value / 1000 if value > 1e11 else value, UTC)
    elif isinstance(value, str) and value.strip():
        try:
            when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
    else:
        return None
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_era(mode: str) -> str:
    """``--exclude-newer``: one of ``ERAS`` or a date/timestamp (ValueError otherwise)."""
    if mode in ERAS:
        return mode
    PythonSpec(exclude_newer=mode)
    return mode


# -- images -------------------------------------------------------------------------------------


def image_archive(images: Path | None, names: Iterable[str]) -> Path | None:
    """``IMAGES/<name with / and : replaced by _>.tar`` of the first name that has one
    (``:latest`` is tried with and without)."""
    if images is None:
        return None
    for name in names:
        if not name:
            continue
        variants = [name]
        if name.endswith(":latest"):
            variants.append(name.removesuffix(":latest"))
        elif ":" not in name.rsplit("/", 1)[-1]:
            variants.append(name + ":latest")
        for v in variants:
            p = images / (v.replace("/", "_").replace(":", "_") + ".tar")
            if p.is_file():
                return p.resolve()
    return None


def swebench_images(instance_id: str) -> list[str]:
    """The SWE-bench harness's instance image names (Docker Hub and local)."""
    key = instance_id.replace("__", "_1776_").lower()
    return [
        f"swebench/sweb.eval.x86_64.{key}:latest",
        f"sweb.eval.x86_64.{key}:latest",
        f"sweb.eval.x86_64.{instance_id.lower()}:latest",
    ]
