"""The learner's two roles meet at one interface: the trainer uses nothing of the
controller but ``TrainerLedger``, the controller implements all of it with the same
signatures, the trainer never ends the run, and the learner's modules import one
another without a cycle."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kiln.learner
from kiln.learner.controller import Controller, RunOutcome
from kiln.learner.ledger import TrainerLedger

LEARNER = Path(kiln.learner.__file__).parent


def _ledger_names() -> set[str]:
    return {n for n, v in vars(TrainerLedger).items() if not n.startswith("_") and callable(v)}


def test_the_trainer_uses_only_the_ledger():
    tree = ast.parse((LEARNER / "trainer.py").read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "controller"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
    }
    assert used and used <= _ledger_names(), used - _ledger_names()
    assert "finish_run" not in (LEARNER / "trainer.py").read_text()


def test_the_controller_implements_the_ledger():
    for name in _ledger_names():
        want = inspect.signature(getattr(TrainerLedger, name))
        got = inspect.signature(getattr(Controller, name))
        assert str(got) == str(want), (name, got, want)
        assert inspect.iscoroutinefunction(getattr(Controller, name)) == inspect.iscoroutinefunction(
            getattr(TrainerLedger, name)
        ), name


def test_run_outcome_names_its_fields():
    assert not RunOutcome().ended and not RunOutcome().ok
    done = RunOutcome("finished", "", 4)
    assert done.ended and done.ok and done.version == 4
    assert not RunOutcome("failed", "why").ok


def _imports(module: str) -> set[str]:
    tree = ast.parse((LEARNER / f"{module}.py").read_text())
    out = set()
    for node in ast.walk(tree):  # lazy imports inside functions count too
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln.learner"):
            out.add(node.module.removeprefix("kiln.learner").lstrip(".") or "__init__")
    return out


def test_no_import_cycle_in_the_learner():
    modules = [p.stem for p in LEARNER.glob("*.py")]
    graph = {m: _imports(m) & set(modules) for m in modules}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for n in graph[start]:
            if n == goal or (n not in seen and reaches(n, goal, seen | {n})):
                return True
        return False

    cyclic = [m for m in modules if reaches(m, m, {m})]
    assert not cyclic, {m: graph[m] for m in cyclic}
