"""Parse a test run's verbose output into ``{test_id: CaseStatus}``.

Understands unittest ``-v`` (``test_x (mod.Class.test_x) ... ok``; the pre-3.11 form
``test_x (mod.Class) ... ok`` too) and pytest ``-rA`` summary lines
(``PASSED path::test_x``). Ids a run never reports are ``missing``, which scores like
a failure: an import error or a crash must never look like a pass.
"""

from __future__ import annotations

import re

from kiln.shared.contracts import CaseStatus

_UNITTEST = re.compile(
    r"^(\w+) \(([\w.]+)\)(?:\n.*?)? \.\.\. (ok|FAIL|ERROR|skipped|expected failure|unexpected success)", re.M
)
_PYTEST = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.M)

_UNITTEST_STATUS = {
    "ok": CaseStatus.PASSED,
    "FAIL": CaseStatus.FAILED,
    "ERROR": CaseStatus.ERROR,
    "skipped": CaseStatus.SKIPPED,
    "expected failure": CaseStatus.PASSED,
    "unexpected success": CaseStatus.FAILED,
}
_PYTEST_STATUS = {
    "PASSED": CaseStatus.PASSED,
    "FAILED": CaseStatus.FAILED,
    "ERROR": CaseStatus.ERROR,
    "SKIPPED": CaseStatus.SKIPPED,
    "XFAIL": CaseStatus.PASSED,
    "XPASS": CaseStatus.FAILED,
}


def parse_test_report(output: str) -> dict[str, CaseStatus]:
    found: dict[str, CaseStatus] = {}
    for name, where, status in _UNITTEST.findall(output):
        test_id = where if where.endswith(f".{name}") else f"{where}.{name}"
        found[test_id] = _UNITTEST_STATUS[status]
    for status, test_id in _PYTEST.findall(output):
        found[test_id] = _PYTEST_STATUS[status]
    return found


def outcome(report: dict[str, CaseStatus], expected: list[str]) -> dict[str, CaseStatus]:
    """Status of each expected id, ``missing`` for ids the run did not report."""
    return {t: report.get(t, CaseStatus.MISSING) for t in expected}
