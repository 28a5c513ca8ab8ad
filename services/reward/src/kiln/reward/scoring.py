"""Turning test results into a reward: pure functions of the task and the report."""

from __future__ import annotations

from kiln.shared.contracts import CaseStatus
from kiln.shared.tasks import Task
from kiln.shared.tasks.report import outcome, parse_test_report


def score(task: Task, output: str, function: str) -> tuple[float, bool, dict[str, CaseStatus]]:
    """(reward, passed, status of every FAIL_TO_PASS and PASS_TO_PASS test)."""
    tests = outcome(parse_test_report(output), task.fail_to_pass + task.pass_to_pass)
    ok = lambda t: tests[t] == CaseStatus.PASSED  # noqa: E731
    passed = all(ok(t) for t in tests)
    if function == "binary":
        return (1.0 if passed else 0.0), passed, tests
    if function == "fraction":
        if not all(ok(t) for t in task.pass_to_pass):
            return 0.0, passed, tests
        return sum(ok(t) for t in task.fail_to_pass) / len(task.fail_to_pass), passed, tests
    raise ValueError(f"unknown reward function {function!r}")
