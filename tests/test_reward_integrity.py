"""kiln's protected test runner and protected paths, as logic: the runner run for real (a
``python -I -S`` process over a scratch repository, no sandbox), the command parsing,
the report's checks and ``protect.plan``. The sandboxed whole is tests/test_reward_attacks.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kiln.shared import contracts as c
from kiln.shared.tasks import load_suite
from kiln.shared.tasks.protect import plan, protection, revert_config_changes
from kiln.shared.tasks.testrun import (
    ReportProblem,
    UnsupportedTestCommand,
    case_statuses,
    read_report,
    runner_command,
    runner_spec,
)

CALC = load_suite("builtin").get("fix-calc")
IDS = CALC.fail_to_pass + CALC.pass_to_pass


def run(tmp_path, files: dict[str, str], ids=IDS, timeout_s: float = 20.0, command: str | None = None):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    cmd = runner_command(command or f"{sys.executable} -m unittest -v test_calc", ids, timeout_s)
    r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    return r, read_report(r.stdout, ids)


def test_the_runner_reports_statuses_and_prints_for_people(tmp_path):
    r, report = run(tmp_path, CALC.files)
    assert report.statuses == "FP" and report.completed and not report.tampered and not report.timed_out
    assert case_statuses(report, IDS) == {IDS[0]: c.CaseStatus.FAILED, IDS[1]: c.CaseStatus.PASSED}
    assert "AssertionError" in report.messages["0"]
    assert "test_add_positive" in r.stderr and "FAIL" in r.stderr  # unittest's -v lines and traceback, on stderr
    assert r.stdout.count("\n") == 0  # one JSON document, nothing else


def test_an_interpreter_of_another_bytecode_version_compiles_the_runner_from_its_source(tmp_path):
    """Both halves of the runner travel compiled for this interpreter's bytecode version
    and as source: with another magic number the runner compiles itself, same report."""
    from importlib.util import MAGIC_NUMBER

    for rel, text in CALC.files.items():
        (tmp_path / rel).write_text(text)
    cmd = runner_command(f"{sys.executable} -m unittest -v test_calc", IDS, 20)
    magic = repr(MAGIC_NUMBER.hex())
    assert cmd.count(magic) == 2, "the parent's and the child's compiled code are both keyed by the magic number"
    reports = []
    for variant in (cmd, cmd.replace(magic, repr("00000000"))):
        r = subprocess.run(
            ["bash", "-c", variant], cwd=tmp_path, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
        )
        reports.append(read_report(r.stdout, IDS))
    assert [(x.statuses, x.completed, x.tampered, x.problems) for x in reports] == [("FP", True, [], [])] * 2


def test_an_id_that_does_not_load_is_missing_and_named(tmp_path):
    _, report = run(tmp_path, CALC.files, ids=[*IDS, "test_calc.TestCalc.test_nope", "nomodule.T.t"])
    assert report.statuses == "FPMM" and report.completed
    assert {w for w, _ in report.errors} == {"test_calc.TestCalc.test_nope", "nomodule.T.t"}


def test_subtests_and_fixtures_fail_their_tests(tmp_path):
    files = {
        "test_calc.py": (
            "import unittest\n\nclass TestCalc(unittest.TestCase):\n"
            "    def test_add_positive(self):\n        for i in range(3):\n            with self.subTest(i=i):\n"
            "                self.assertLess(i, 2)\n\n    def test_add_zero(self):\n        pass\n\n"
            "class TestBroken(unittest.TestCase):\n    @classmethod\n    def setUpClass(cls):\n        raise RuntimeError('no db')\n\n"
            "    def test_x(self):\n        pass\n"
        )
    }
    _, report = run(tmp_path, files, ids=[*IDS, "test_calc.TestBroken.test_x"])
    assert report.statuses == "FPM"
    assert any("setUpClass" in w and "no db" in m for w, m in report.errors)


def test_the_code_under_test_cannot_reach_the_report(tmp_path):
    # Every fd of the test process, the event pipe included: none of it forges the report;
    # the run is incomplete. (The parent's /proc entries and signals to it are covered in
    # the sandbox, where the runner is pid 1 and the tests have no capability:
    # tests/test_reward_attacks.py; here the test runs as root, which may read /proc.)
    forged = json.dumps(
        {"kiln_runner": 1, "framework": "unittest", "count": 2, "statuses": "PP", "completed": True, "timed_out": False}
    )
    attack = (
        f"import os, signal\nr = {forged!r}.encode()\n"
        "for fd in range(0, 32):\n    try: os.write(fd, r)\n    except OSError: pass\n"
        "os._exit(0)\n"
    )
    r, report = run(tmp_path, {**CALC.files, "calc.py": attack + CALC.files["calc.py"]})
    assert report.statuses == "MM" and not report.completed and report.child_exit == 0, r.stderr


def test_framework_patches_are_tampering(tmp_path):
    patch = "import unittest\nunittest.TestCase.run = lambda self, result=None: result.addSuccess(self)\n"
    _, report = run(tmp_path, {**CALC.files, "calc.py": patch + CALC.files["calc.py"]})
    assert "unittest.case.TestCase.run" in report.tampered


def test_isolated_interpreter_ignores_the_workspace_and_the_environment(tmp_path):
    hook = "import os\nos._exit(3)\n"
    files = {
        **CALC.files,
        "sitecustomize.py": hook,
        "usercustomize.py": hook,
        "unittest.py": hook,
        "x.pth": "import os; os._exit(3)\n",
    }
    cmd = runner_command(f"{sys.executable} -m unittest -v test_calc", IDS, 20)
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(tmp_path),
        "PYTHONSTARTUP": str(tmp_path / "sitecustomize.py"),
        "PYTHONUSERBASE": str(tmp_path),
    }
    r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert read_report(r.stdout, IDS).statuses == "FP", r.stderr


def test_a_hang_is_killed_at_the_deadline_with_its_finished_tests_kept(tmp_path):
    hang = CALC.files["test_calc.py"].replace("self.assertEqual(add(0, 0), 0)", "import time\n        time.sleep(3600)")
    _, report = run(tmp_path, {**CALC.files, "test_calc.py": hang}, timeout_s=3)
    assert report.timed_out and not report.completed and report.statuses == "FM" and report.child_signal == 9


def test_pytest_through_the_runner(tmp_path):
    pytest_cmd = f"{sys.executable} -m pytest -rA -p no:cacheprovider -k add --import-mode=prepend tests"
    files = {
        "calc.py": "def add(a, b):\n    return a - b\n",
        "tests/test_calc.py": "import pytest\nfrom calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n\n"
        "def test_zero():\n    assert add(0, 0) == 0\n\n@pytest.mark.xfail\ndef test_xf():\n    assert 0\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('setup')\n\ndef test_setup(broken):\n    pass\n",
    }
    ids = [
        "tests/test_calc.py::test_add",
        "tests/test_calc.py::test_zero",
        "tests/test_calc.py::test_xf",
        "tests/test_calc.py::test_setup",
    ]
    r, report = run(tmp_path, files, ids=ids, command=pytest_cmd)
    # plugins and --name=value options kept; selection and targets dropped: the ids are what runs
    assert runner_spec(pytest_cmd).args == ("-p", "no:cacheprovider", "--import-mode=prepend")
    assert report.framework == "pytest" and report.completed, r.stderr
    assert report.statuses == "FPPE", (report, r.stderr)


# The runner's parts (issue 30): pristine code run to its end, authenticated events.

PKG_FILES = {
    "calc/__init__.py": "def add(a, b):\n    return a - b\n",
    "tests/test_calc.py": "import pytest\n\nfrom calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_zero():\n    assert add(0, 0) == 0\n",
}
PKG_IDS = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_zero"]
KINDS = {
    "unittest": (CALC.files, "calc.py", IDS, f"{sys.executable} -m unittest -v test_calc"),
    "pytest": (PKG_FILES, "calc/__init__.py", PKG_IDS, f"{sys.executable} -m pytest -rA -p no:cacheprovider tests"),
}


def run_task(tmp_path, files: dict[str, str], ids, command: str, test_files: dict[str, str], timeout_s: float = 20.0):
    """The runner as the clean room starts it: with the task's test files and their sha256."""
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    cmd = runner_command(command, ids, timeout_s, test_files)
    r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    return r, read_report(r.stdout, ids)


INPROC = [
    "SWAP_CODE",
    "BUILD_CLASS",
    "PROFILE",
    "EXPECT_FAILURE",
    "OUTCOME",
    "FORGE_EVENTS",
    "VIA_MAIN",
    "WRAP_WRITE",
    "SWAP_MODULE",
]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("attack", INPROC)
def test_attacks_from_the_test_process_never_pass(tmp_path, kind, attack):
    import attacks_in_process

    files, code, ids, command = KINDS[kind]
    tests = {p: t for p, t in files.items() if "test" in p}
    r, report = run_task(
        tmp_path, {**files, code: getattr(attacks_in_process, attack) + files[code]}, ids, command, tests
    )
    assert report.statuses[0] != "P", (report, r.stderr[-2000:])
    if attack == "FORGE_EVENTS":  # it wrote the old format and a `ready` of its own, then exited
        assert not report.completed and report.statuses == "MM" and any("unauthenticated" in p for p in report.problems)
    else:
        assert report.completed and report.tampered, (report, r.stderr[-2000:])


def test_a_workspace_package_named_like_the_test_module_is_never_loaded(tmp_path):
    import attacks_in_process

    files = {**CALC.files, "test_calc/__init__.py": attacks_in_process.SHADOW_TEST_PACKAGE}
    r, report = run_task(tmp_path, files, IDS, KINDS["unittest"][3], CALC.test_files)
    assert report.statuses == "FP" and report.completed and not report.tampered, r.stderr
    assert "test_calc.py" in report.messages["0"] or "-1 != 5" in report.messages["0"]


def test_legit_decorators_and_inherited_tests_still_pass(tmp_path):
    test = (
        "import unittest\nfrom unittest import mock\n\nimport calc\n\n\n"
        "class Base(unittest.TestCase):\n    def test_inherited(self):\n        self.assertEqual(calc.add(0, 0), 0)\n\n\n"
        "class TestCalc(Base):\n"
        "    @mock.patch('calc.add', return_value=5)\n    def test_patched(self, add):\n        self.assertEqual(calc.add(2, 3), 5)\n\n"
        "    @unittest.skip('not today')\n    def test_skipped(self):\n        raise AssertionError\n\n"
        "    @unittest.expectedFailure\n    def test_known_bug(self):\n        self.assertEqual(calc.add(2, 3), 5)\n\n"
        "    async def helper(self):\n        return 1\n\n\n"
        "class TestAsync(unittest.IsolatedAsyncioTestCase):\n    async def test_coroutine(self):\n"
        "        self.assertEqual(calc.add(0, 0), 0)\n\n\n"
        "def _make(n):\n    def test(self):\n        self.assertEqual(calc.add(n, 0), n)\n    return test\n\n\n"
        "for _n in (1, 2):\n    setattr(TestCalc, 'test_generated_%d' % _n, _make(_n))\n"
    )
    ids = [
        f"test_calc.TestCalc.{t}"
        for t in (
            "test_inherited",
            "test_patched",
            "test_skipped",
            "test_known_bug",
            "test_generated_1",
            "test_generated_2",
        )
    ] + ["test_calc.TestAsync.test_coroutine"]
    r, report = run_task(
        tmp_path,
        {"calc.py": CALC.files["calc.py"], "test_calc.py": test},
        ids,
        KINDS["unittest"][3],
        {"test_calc.py": test},
    )
    assert report.statuses == "PPSPPPP" and report.completed and not report.tampered, (report, r.stderr[-3000:])


@pytest.mark.parametrize("kind", ["unittest", "pytest"])
def test_tests_inherited_from_a_sibling_test_module_pass_and_a_swapped_base_is_tampering(tmp_path, kind):
    """A test class whose tests come from a base class in another test module of the
    protected folder (itsdangerous's layout): the base module is served from its pristine
    bytes too, so its inherited tests are witnessed; a base method swapped at run time is not."""
    base = (
        "import unittest\n\nimport calc\n\n\nclass TestBase(unittest.TestCase):\n"
        "    def test_zero(self):\n        self.assertEqual(calc.add(0, 0), 0)\n"
    )
    test = (
        "import calc\nfrom tests.test_base import TestBase\n\n\nclass TestMore(TestBase):\n"
        "    def test_one(self):\n        self.assertEqual(calc.add(1, 0), 1)\n"
    )
    files = {
        "calc.py": CALC.files["calc.py"],
        "tests/__init__.py": "",
        "tests/test_base.py": base,
        "tests/test_more.py": test,
    }
    if kind == "unittest":
        ids, command = (
            ["tests.test_more.TestMore.test_zero", "tests.test_more.TestMore.test_one"],
            f"{sys.executable} -m unittest -v",
        )
    else:
        ids = ["tests/test_more.py::TestMore::test_zero", "tests/test_more.py::TestMore::test_one"]
        command = f"{sys.executable} -m pytest -p no:cacheprovider tests"
    r, report = run_task(tmp_path, files, ids, command, {"tests/test_more.py": test})
    assert report.statuses == "PP" and report.completed and not report.tampered, (report, r.stderr[-3000:])
    swap = (
        "import sys\n_m = sys.modules.get('tests.test_base')\n"
        "if _m is not None:\n    _m.TestBase.test_zero.__code__ = (lambda self: None).__code__\n"
    )
    files["tests/test_more.py"] = test.replace("\n\n\nclass", "\nimport calc_hook\n\n\nclass", 1)
    files["calc_hook.py"] = swap  # the code under test, imported after the base module
    more = files["tests/test_more.py"]
    r, report = run_task(tmp_path, files, ids, command, {"tests/test_more.py": more})
    assert report.statuses[0] != "P" and report.tampered, (report, r.stderr[-3000:])


def test_a_package_the_framework_imports_is_the_repository_s_in_the_tests(tmp_path):
    """pytest imports ``iniconfig`` from the environment before the workspace is on any
    path; when the repository under test is iniconfig, its tests still import the
    repository's code, not the framework's copy."""
    files = {
        "iniconfig/__init__.py": "WHERE = 'workspace'\n",
        "tests/test_where.py": "import iniconfig\n\n\ndef test_where():\n    assert iniconfig.WHERE == 'workspace'\n",
    }
    ids = ["tests/test_where.py::test_where"]
    r, report = run_task(
        tmp_path,
        files,
        ids,
        f"{sys.executable} -m pytest -p no:cacheprovider tests",
        {"tests/test_where.py": files["tests/test_where.py"]},
    )
    assert report.statuses == "P" and report.completed and not report.tampered, (report, r.stderr[-3000:])


def test_pytest_parametrize_fixtures_classes_and_marks_still_pass(tmp_path):
    test = (
        "import pytest\nfrom unittest import mock\n\nimport calc\n\n\n"
        "@pytest.fixture\ndef zero():\n    return 0\n\n\n"
        "@pytest.mark.parametrize('a,b', [(0, 0), pytest.param(2, 3, marks=pytest.mark.xfail(reason='the bug'))])\n"
        "def test_param(a, b, zero):\n    assert calc.add(a, b) == a + b + zero\n\n\n"
        "class TestGroup:\n    def test_method(self, zero):\n        assert calc.add(zero, 0) == 0\n\n"
        "    @pytest.mark.xfail(strict=True)\n    def test_xfail(self):\n        assert calc.add(2, 3) == 5\n\n\n"
        "@mock.patch('calc.add', return_value=5)\ndef test_patched(add):\n    assert calc.add(2, 3) == 5\n\n\n"
        "@pytest.mark.skip(reason='later')\ndef test_skipped():\n    assert False\n"
    )
    ids = [
        "tests/test_x.py::test_param[0-0]",
        "tests/test_x.py::test_param[2-3]",
        "tests/test_x.py::TestGroup::test_method",
        "tests/test_x.py::TestGroup::test_xfail",
        "tests/test_x.py::test_patched",
        "tests/test_x.py::test_skipped",
    ]
    files = {"calc.py": CALC.files["calc.py"], "tests/test_x.py": test}
    r, report = run_task(tmp_path, files, ids, KINDS["pytest"][3], {"tests/test_x.py": test})
    assert report.statuses == "PPPPPS" and report.completed and not report.tampered, (report, r.stderr[-3000:])
    assert "- where -1 = " in report.messages.get("1", "") or True  # xfail passes carry no message


def test_pytest_failures_keep_pytest_s_rewritten_assertion_messages(tmp_path):
    files, _, ids, command = KINDS["pytest"]
    _, report = run_task(tmp_path, files, ids, command, {"tests/test_calc.py": files["tests/test_calc.py"]})
    assert report.statuses == "FP" and "where -1 = add(2, 3)" in report.messages["0"]


def test_a_test_file_that_is_not_the_task_s_is_tampering(tmp_path):
    files, _, ids, command = KINDS["unittest"]
    _, report = run_task(tmp_path, files, IDS, command, {"test_calc.py": files["test_calc.py"] + "# other\n"})
    assert report.tampered == ["test file test_calc.py is not the task's"]


def test_events_are_verified_by_the_parent(tmp_path):
    """The parent's side of the channel, against a real forked writer: the key goes out
    only for a `ready` made with the token; an event with a wrong MAC, or replayed, is a
    problem; a `done` followed by anything is not a completed run."""
    import hashlib
    import hmac
    import os

    from kiln.shared.tasks import runner

    token, key = os.urandom(32), os.urandom(32)

    def line(seq, event):
        payload = repr(event).encode()
        return hmac.new(key, b"%d " % seq + payload, hashlib.sha256).hexdigest().encode() + b" " + payload + b"\n"

    def child(lines_after_key, forged_ready=False):
        r, w = os.pipe()
        kr, kw = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            if forged_ready:
                os.write(w, b"ready " + b"0" * 64 + b"\n")
            os.write(w, b"ready " + hmac.new(token, b"ready", hashlib.sha256).hexdigest().encode() + b"\n")
            got = os.read(kr, 32)
            mask = hmac.new(token, b"key", hashlib.sha256).digest()
            assert bytes(a ^ b for a, b in zip(got, mask)) == key
            for data in lines_after_key:
                os.write(w, data)
            os._exit(0)
        os.close(w)
        os.close(kr)
        return runner.read_events(r, kw, token, key, pid, 10)

    good = [
        line(0, ("result", IDS[0], "passed", "", 0.1)),
        line(0, ("result", IDS[1], "passed", "", 0.1)),
        line(1, ("result", IDS[1], "failed", "", 0.1)),
        b"0" * 64 + b" ('result', 'x', 'passed', '', 0)\n",
        line(2, ("done", [], [])),
    ]
    events, problems, timed_out, status = child(good, forged_ready=True)
    assert [e[0] for e in events] == ["result", "result", "done"] and len(problems) == 3 and not timed_out
    assert any("before the runner was ready" in p for p in problems)
    rep = runner.report({"framework": "unittest", "ids": IDS}, events, problems, False, status, 0.0, [])
    assert rep["statuses"] == "PF" and rep["completed"]
    events, problems, _, status = child(good + [line(3, ("result", IDS[0], "failed", "", 0.1))])
    rep = runner.report({"framework": "unittest", "ids": IDS}, events, problems, False, status, 0.0, [])
    assert not rep["completed"] and "an event after the runner's end" in rep["problems"]


@pytest.mark.parametrize(
    "command,framework",
    [
        ("python3 -m unittest -v test_calc", "unittest"),
        ("PYTHONDONTWRITEBYTECODE=1 python -m pytest -rA -p no:cacheprovider --color=no tests/a.py", "pytest"),
        ("/usr/local/bin/python3.11 -m pytest -q tests", "pytest"),
    ],
)
def test_supported_test_commands(command, framework):
    assert runner_spec(command).framework == framework


@pytest.mark.parametrize(
    "command",
    [
        "python tests/runtests.py --verbosity 2",
        "bash run_tests.sh",
        "python -m unittest -v t; echo OK",
        "touch x; python3 -m unittest",
        "python -c 'print(1)'",
        "pytest tests",
    ],
)
def test_unsupported_test_commands_are_refused(command):
    with pytest.raises(UnsupportedTestCommand):
        runner_spec(command)


@pytest.mark.parametrize(
    "stdout,why",
    [
        ("", "no report"),
        ("OK\n", "not valid"),
        (
            '{"kiln_runner": 1, "framework": "unittest", "count": 2, "statuses": "P", "completed": true, "timed_out": false}',
            "covers 1",
        ),
        (
            '{"kiln_runner": 1, "framework": "unittest", "count": 2, "statuses": "PX", "completed": true, "timed_out": false}',
            "not valid",
        ),
        (
            '{"kiln_runner": 1, "framework": "unittest", "count": 2, "statuses": "PP", "completed": true, "timed_out": false}{"x": 1}',
            "not valid",
        ),
    ],
)
def test_unusable_reports_are_refused(stdout, why):
    with pytest.raises(ReportProblem, match=why):
        read_report(stdout, IDS)


def test_protected_paths():
    p = protection(["tests/unit/test_a.py", "test_root.py", "pkg/tests/test_b.py"], ["fixtures/*"])
    assert (
        p.reason("tests/unit/test_a.py") and p.reason("tests/new_helper.py") and p.reason("tests")
    )  # the whole folder
    assert p.reason("pkg/tests/data.json") and p.reason("test_other.py") and p.reason("other_test.py")
    assert p.reason("conftest.py") and p.reason("src/pkg/conftest.py") and p.reason("pytest.ini")
    assert p.reason("fixtures/golden.txt") and p.reason("test_root.py/inside")  # a file turned into a folder
    assert not p.reason("calc.py") and not p.reason("pkg/calc.py") and not p.reason("pyproject.toml")
    diff = c.WorkspaceDiff(
        changed={
            "calc.py": "x",
            "conftest.py": "y",
            "pyproject.toml": "[tool.pytest.ini_options]\naddopts='-x'\n",
            "setup.cfg": "[metadata]\nname = calc2\n",
        },
        deleted=["tests/unit/test_a.py", "old.py"],
        binary=["tests/link", "blob.bin"],
    )
    room = plan(p, diff)
    assert room.changed.keys() == {"calc.py", "pyproject.toml", "setup.cfg"} and room.deleted == ["old.py"]
    assert set(room.protected) == {"conftest.py", "tests/unit/test_a.py", "tests/link"}
    assert room.not_reproduced == ["blob.bin"] and room.config_checks == ["pyproject.toml", "setup.cfg"]
    # pyproject's pytest section changed (reverted); setup.cfg's metadata only (kept)
    revert_config_changes(
        room, {"pyproject.toml": "[project]\nname='calc'\n", "setup.cfg": "[metadata]\nname = calc\n"}
    )
    assert "pyproject.toml" in room.protected and "pyproject.toml" not in room.changed and "setup.cfg" in room.changed


def test_deletions_go_in_commands_of_bounded_length():
    from kiln.reward.cleanroom import DELETE_BATCH_CHARS, _batches

    words = [f"dir/file_{i:05d}.py" for i in range(20000)]  # an agent that deleted a big folder
    batches = _batches(words)
    assert [w for b in batches for w in b] == words and len(batches) > 1
    assert all(sum(len(w) + 1 for w in b) <= DELETE_BATCH_CHARS for b in batches)
    assert _batches([]) == []


def test_config_files_no_parser_can_bound_count_as_changed():
    """A pyproject.toml nested past the recursion limit, or past MAX_CONFIG_CHARS, is
    unreadable (any change to it is reverted), never a parser crash in reward; paths
    the diff did not walk (too deep, too long) are not reproduced."""
    from kiln.shared.tasks.protect import MAX_CONFIG_CHARS, test_sections

    deep = "x = " + "[" * 5000 + "]" * 5000 + "\n"
    assert test_sections("pyproject.toml", deep) == ("unreadable", deep)
    huge = "[project]\nname = 'x'\n" + "# pad\n" * (MAX_CONFIG_CHARS // 6 + 1)
    assert test_sections("pyproject.toml", huge)[0] == "unreadable"
    diff = c.WorkspaceDiff(
        changed={"pyproject.toml": deep, "calc.py": "x"}, omitted=["a/" * 100, "tests/" + "d" * 1100]
    )
    room = plan(protection(["tests/test_calc.py"]), diff)
    revert_config_changes(room, {"pyproject.toml": None})
    assert "pyproject.toml" in room.protected and room.changed == {"calc.py": "x"}
    assert room.not_reproduced == ["a/" * 100] and "tests/" + "d" * 1100 in room.protected
