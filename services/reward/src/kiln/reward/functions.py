"""Reward functions: pure functions of a trajectory and its test results.

A reward function is ``fn(trajectory, results) -> float`` (``RewardFunction``). The
service resolves ``reward.function`` as a built-in name (``binary``, ``fraction``), the
name of an entry point in the ``kiln.reward_functions`` group (how a package ships its
own, e.g. an LLM judge or a custom verifier), or ``package.module:function``. Shaping
terms (``reward.shaping``) are added on top and recorded separately
(``ScoredTrajectory.reward_terms``), so the tests' score stays visible on its own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

from kiln.shared.contracts import CaseStatus, Trajectory


@dataclass(frozen=True)
class TestResults:
    __test__ = False  # a result type, not a pytest class

    tests: dict[str, CaseStatus]
    """Status of every FAIL_TO_PASS and PASS_TO_PASS test (``missing`` if it never ran)."""
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    output: str
    timed_out: bool

    def passed(self, test_id: str) -> bool:
        return self.tests.get(test_id) == CaseStatus.PASSED

    @property
    def all_passed(self) -> bool:
        return all(self.passed(t) for t in self.fail_to_pass + self.pass_to_pass)


RewardFunction = Callable[[Trajectory, TestResults], float]


def binary(_trajectory: Trajectory, r: TestResults) -> float:
    """1 when every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0."""
    return 1.0 if r.all_passed else 0.0


def fraction(_trajectory: Trajectory, r: TestResults) -> float:
    """Share of FAIL_TO_PASS tests passing; 0 if any PASS_TO_PASS test broke."""
    if not all(r.passed(t) for t in r.pass_to_pass):
        return 0.0
    return sum(r.passed(t) for t in r.fail_to_pass) / len(r.fail_to_pass)


BUILTIN: dict[str, RewardFunction] = {"binary": binary, "fraction": fraction}


def resolve(spec: str) -> RewardFunction:
    if spec in BUILTIN:
        return BUILTIN[spec]
    for ep in entry_points(group="kiln.reward_functions"):
        if ep.name == spec:
            return ep.load()
    module, sep, attr = spec.partition(":")
    if not sep:
        known = sorted(BUILTIN) + [ep.name for ep in entry_points(group="kiln.reward_functions")]
        raise ValueError(f"reward function {spec!r}: not one of {known} and not 'package.module:function'")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn


SHAPING_TERMS = ("malformed_tool_calls", "generated_tokens_k", "turns", "no_final_answer")
"""What ``reward.shaping`` may weigh: malformed tool calls (count), generated tokens (in
thousands), assistant turns (count), and 1 when the episode ended by a limit instead of
an answer without a tool call."""


def shaping(trajectory: Trajectory, weights: dict[str, float]) -> dict[str, float]:
    amounts = {
        "malformed_tool_calls": float(trajectory.malformed_tool_calls),
        "generated_tokens_k": sum(trajectory.loss_mask) / 1000.0,
        "turns": float(trajectory.num_turns),
        "no_final_answer": 0.0 if trajectory.finish_reason == "no_tool_call" else 1.0,
    }
    return {name: weight * amounts[name] + 0.0 for name, weight in weights.items()}  # + 0.0: no -0.0
