"""The rooms of the code base, checked from the source (lazy imports inside functions too):

- ``kiln.shared`` is the library every service imports: it imports no service and not
  ``kiln.ops`` (the operator commands, which start and drive the services);
- a service imports only ``kiln.shared`` and itself: never another service, never ``kiln.ops``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"envpool": "env-pool", "learner": "learner", "reward": "reward", "rollout": "rollout", "weights": "weights"}
PACKAGES = {
    "shared": ROOT / "shared/src/kiln/shared",
    **{k: ROOT / f"services/{v}/src/kiln/{k}" for k, v in SERVICES.items()},
}


def kiln_imports(folder: Path) -> dict[str, set[str]]:
    """Top-level kiln package (``shared``, ``ops``, a service) -> the files that import it."""
    out: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "kiln" and len(parts) > 1:
                    out.setdefault(parts[1], set()).add(str(path.relative_to(ROOT)))
    return out


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_each_package_imports_only_what_its_room_allows(package: str):
    allowed = {"shared"} | ({package} if package != "shared" else set())
    found = kiln_imports(PACKAGES[package])
    assert found, f"no kiln import found under {PACKAGES[package]}: the check would pass vacuously"
    wrong = {k: sorted(v) for k, v in found.items() if k not in allowed}
    assert not wrong, f"kiln.{package} imports outside its room: {wrong}"


def test_the_operator_package_is_where_the_services_are_driven_from():
    found = kiln_imports(ROOT / "ops/src/kiln/ops")
    assert "envpool" in found and "shared" in found, found
