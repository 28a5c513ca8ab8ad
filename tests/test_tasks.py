"""The task format and the built-in suite: every built-in task's FAIL_TO_PASS tests
really fail on its files and pass with its reference fix; the loaders and the test
report parser behave as docs/tasks.md says."""

from __future__ import annotations

import json

import pytest

from kiln.shared.contracts import CaseStatus
from kiln.shared.tasks import Task, load_suite
from kiln.shared.tasks.make_builtin import SPECS, _run
from kiln.shared.tasks.report import outcome, parse_test_report

SUITE = load_suite("builtin")


def test_builtin_suite_shape():
    assert len(SUITE) == len(SPECS) >= 20
    assert len(SUITE.split("train")) >= 12 and len(SUITE.split("heldout")) >= 4
    with pytest.raises(ValueError, match="no tasks in split"):
        SUITE.split("nope")
    with pytest.raises(KeyError, match="not in suite"):
        SUITE.get("nope")


@pytest.mark.parametrize("task", SUITE.tasks, ids=lambda t: t.id)
def test_builtin_task_is_valid(task: Task):
    before = outcome(_run(task.files, task.test_command), task.fail_to_pass + task.pass_to_pass)
    after = outcome(_run({**task.files, **task.solution}, task.test_command), task.fail_to_pass + task.pass_to_pass)
    assert all(before[t] != CaseStatus.PASSED for t in task.fail_to_pass), before
    assert all(before[t] == CaseStatus.PASSED for t in task.pass_to_pass), before
    assert all(s == CaseStatus.PASSED for s in after.values()), after


def test_directory_and_jsonl_suites(tmp_path):
    d = tmp_path / "suite" / "my-task"
    (d / "repo" / "pkg").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution" / "pkg").mkdir(parents=True)
    (d / "repo" / "pkg" / "m.py").write_text("X = 1\n")
    (d / "tests" / "test_m.py").write_text("...")
    (d / "solution" / "pkg" / "m.py").write_text("X = 2\n")
    (d / "task.toml").write_text(
        'problem_statement = "make X 2"\nfail_to_pass = ["test_m.T.test_x"]\nsplit = "heldout"\n'
    )
    s = load_suite(str(tmp_path / "suite"))
    t = s.get("my-task")
    assert (
        t.files == {"pkg/m.py": "X = 1\n"}
        and t.test_files == {"test_m.py": "..."}
        and t.solution == {"pkg/m.py": "X = 2\n"}
    )
    assert t.split == "heldout"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"id": "x", "problem_statement": "p", "files": {"../up.py": ""}, "fail_to_pass": ["a"]}) + "\n"
    )
    with pytest.raises(ValueError, match="(?s)bad.jsonl:1: invalid task.*stay inside"):
        load_suite(str(bad))
    dup = tmp_path / "dup.jsonl"
    line = json.dumps({"id": "x", "problem_statement": "p", "files": {}, "fail_to_pass": ["a"]})
    dup.write_text(line + "\n" + line + "\n")
    with pytest.raises(ValueError, match="duplicate task id"):
        load_suite(str(dup))
    with pytest.raises(ValueError, match="FAIL_TO_PASS"):
        Task(id="x", problem_statement="p", files={}, fail_to_pass=[])


def test_report_parser_unittest_and_pytest():
    out = (
        "test_a (test_m.TestM.test_a) ... ok\n"
        "test_b (test_m.TestM.test_b) ... FAIL\n"
        "test_c (test_m.TestM) ... ERROR\n"  # the pre-3.11 format
        "test_d (test_m.TestM.test_d) ... skipped 'later'\n"
        "PASSED tests/test_x.py::test_one\n"
        "FAILED tests/test_x.py::test_two - AssertionError\n"
    )
    r = parse_test_report(out)
    assert r == {
        "test_m.TestM.test_a": CaseStatus.PASSED,
        "test_m.TestM.test_b": CaseStatus.FAILED,
        "test_m.TestM.test_c": CaseStatus.ERROR,
        "test_m.TestM.test_d": CaseStatus.SKIPPED,
        "tests/test_x.py::test_one": CaseStatus.PASSED,
        "tests/test_x.py::test_two": CaseStatus.FAILED,
    }
    assert outcome(r, ["test_m.TestM.test_a", "never.ran"]) == {
        "test_m.TestM.test_a": CaseStatus.PASSED,
        "never.ran": CaseStatus.MISSING,
    }


CONSTANTS = load_suite("constants")


def test_constants_suite_is_deterministic_and_its_splits_disjoint():
    from kiln.shared.tasks.constants import HELDOUT, TRAIN, generate

    assert [t.model_dump() for t in generate()] == [t.model_dump() for t in CONSTANTS.tasks]
    assert len(CONSTANTS.split("train")) == TRAIN and len(CONSTANTS.split("heldout")) == HELDOUT
    key = lambda t: tuple(t.metadata[k] for k in ("module", "constant", "old", "new"))  # noqa: E731
    assert not {key(t) for t in CONSTANTS.split("train")} & {key(t) for t in CONSTANTS.split("heldout")}
    t = CONSTANTS.tasks[0]
    m = t.metadata
    assert f"`{m['constant']}` in `{m['module']}` is {m['old']} but must be {m['new']}" in t.problem_statement
    assert f"{m['constant']} = {m['old']}\n" in t.files[m["module"]]
    for t in CONSTANTS.tasks:
        m = t.metadata
        assert t.files[m["module"]].splitlines()[m["target_line"] - 1] == f"{m['constant']} = {m['old']}"
    assert {t.metadata["target_line"] for t in CONSTANTS.split("heldout")} == {1, 2}


@pytest.mark.parametrize("task", CONSTANTS.tasks[:3] + CONSTANTS.split("heldout")[:3], ids=lambda t: t.id)
def test_constants_task_is_valid(task: Task):
    before = outcome(_run(task.files, task.test_command), task.fail_to_pass + task.pass_to_pass)
    after = outcome(_run({**task.files, **task.solution}, task.test_command), task.fail_to_pass + task.pass_to_pass)
    assert [before[t] for t in task.fail_to_pass] == [CaseStatus.FAILED]
    assert all(before[t] == CaseStatus.PASSED for t in task.pass_to_pass), before
    assert all(s == CaseStatus.PASSED for s in after.values()), after
