"""Running a task's tests the way reward trusts: the command that starts kiln's protected
runner (``runner.py``) in a sandbox, and the report it gives back.

A task says how its tests run with ``test_command`` (``python -m unittest -v mod`` or
``python -m pytest -rA files``, docs/tasks.md). ``runner_spec`` reads the interpreter and
the framework from it; the runner then runs exactly the task's FAIL_TO_PASS and
PASS_TO_PASS ids, whatever targets the command named. A command kiln cannot map onto
its runner (a custom script, Django's ``runtests.py``) raises ``UnsupportedTestCommand``:
such a task cannot be scored without trusting text the tested code prints.

Invariants: the runner reaches the sandbox in the command line itself (nothing of it is
in the workspace, so nothing there can replace it); the report is read from the
runner's stdout only and must be one JSON document of the runner's format with a
status for every id it was asked to run, else ``read_report`` says why it is unusable
(``ReportProblem``), and the caller scores 0 with that reason.
"""

from __future__ import annotations

import base64
import hashlib
import json
import marshal
import re
import shlex
import zlib
from dataclasses import dataclass
from functools import cache
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from kiln.shared.contracts import CaseStatus

RUNNER = Path(__file__).with_name("runner.py")
RUNNER_CHILD = tuple(Path(__file__).with_name(f"runner_{part}.py") for part in ("child", "guard", "drivers"))
"""The test process's half of the runner (its core, then its framework drivers), inlined
into the runner's source: one program."""
MAX_CONFIG_BYTES = 96 * 1024
"""Compressed ids and arguments (a command line's single argument must stay under 128 KiB)."""

_PYTEST_KEEP_WITH_VALUE = {"-p", "-o", "-W"}
_PYTEST_DROP_WITH_VALUE = {
    "-k",
    "-m",
    "--tb",
    "-c",
    "--rootdir",
    "--junitxml",
    "--junit-xml",
    "--deselect",
    "--ignore",
    "--maxfail",
}
"""Selection and reporting: the runner runs exactly the task's ids and reports itself."""
_PYTEST_DROP_PREFIXES = (
    "--junit",
    "--tb=",
    "--color=",
    "--rootdir=",
    "--deselect=",
    "--ignore=",
    "--maxfail=",
    "--result-log",
)
_SHELL = re.compile(r"[;&|`$<>(){}\n]")


class UnsupportedTestCommand(ValueError):
    """A ``test_command`` that is not ``python -m unittest`` or ``python -m pytest``."""


@dataclass(frozen=True)
class RunnerSpec:
    python: str
    """The interpreter, as the command named it (a name on the sandbox's PATH or a path)."""
    framework: Literal["unittest", "pytest"]
    args: tuple[str, ...] = ()
    """pytest options kept (``-p``, ``-o``, ``-W`` and ``--name=value`` forms); targets,
    selection (``-k``, ``-m``) and reporting options are dropped: the runner runs exactly
    the task's ids and reports them itself."""


@cache
def runner_spec(test_command: str) -> RunnerSpec:
    if _SHELL.search(test_command):
        raise UnsupportedTestCommand(f"test command {test_command!r} is a shell pipeline, not one test run")
    try:
        words = shlex.split(test_command)
    except ValueError as e:
        raise UnsupportedTestCommand(f"test command {test_command!r}: {e}") from None
    while words and "=" in words[0] and not words[0].startswith(("-", "/")):  # VAR=value prefixes
        words.pop(0)
    if (
        len(words) < 3
        or words[1] != "-m"
        or words[2] not in ("unittest", "pytest")
        or "python" not in Path(words[0]).name
    ):
        raise UnsupportedTestCommand(
            f"test command {test_command!r} is not `python -m unittest ...` or `python -m pytest ...`: reward runs tests "
            "only through kiln's runner, which reads results from the framework itself, never from printed text (docs/reward.md)"
        )
    python, framework, rest = words[0], words[2], words[3:]
    args: list[str] = []
    if framework == "pytest":
        it = iter(rest)
        for w in it:
            if w in _PYTEST_KEEP_WITH_VALUE:  # a plugin switched off, an ini override, a warning filter
                args += [w, next(it, "")]
            elif w in _PYTEST_DROP_WITH_VALUE:
                next(it, None)
            elif w.startswith("--") and "=" in w and not w.startswith(_PYTEST_DROP_PREFIXES):
                args.append(w)
    return RunnerSpec(python, framework, tuple(args))  # type: ignore[arg-type]


@cache
def _runner_source() -> str:
    """A short bootstrap that runs runner.py, with the test process's source
    (``runner_child.py``, ``runner_guard.py``, ``runner_drivers.py``) beside it; each half travels as its
    source (zlib, base64) and, for an interpreter of this one's bytecode version, as its
    code already compiled (marshal): compiling them in every run cost more than the rest
    of the runner's own work (runner.py alone: about 4 ms a run)."""
    source = RUNNER.read_text()
    marker = "\nCHILD_SOURCE = None"
    assert source.count(marker) == 1, "runner.py must hold one CHILD_SOURCE line"
    parent = source.replace(marker, "\nCHILD_SOURCE = _kiln_child", 1)
    child = "\n\n".join(p.read_text() for p in RUNNER_CHILD)

    def packed(text: str, filename: str) -> tuple[str, str]:
        code = marshal.dumps(compile(text, filename, "exec", dont_inherit=True))
        return tuple(base64.b64encode(zlib.compress(b, 9)).decode() for b in (text.encode(), code))  # type: ignore[return-value]

    magic = MAGIC_NUMBER.hex()
    child_source, child_code = packed(child, "<kiln-runner-child>")
    parent_source, parent_code = packed(parent, "<kiln-runner>")
    # The bootstrap's names are the only ones it leaves in __main__ beside runner.py's own.
    return (
        f"_kiln_child = ({child_source!r}, {magic!r}, {child_code!r})\n"
        "import base64, marshal, zlib\n"
        "from _frozen_importlib_external import MAGIC_NUMBER as _kiln_magic\n"
        f"exec(marshal.loads(zlib.decompress(base64.b64decode({parent_code!r})))"
        f" if _kiln_magic.hex() == {magic!r} else compile(zlib.decompress(base64.b64decode("
        f"{parent_source!r})).decode(), '<kiln-runner>', 'exec', dont_inherit=True))\n"
    )


def runner_command(
    test_command: str, ids: list[str], timeout_s: float, test_files: dict[str, str] | None = None
) -> str:
    """The bash command that runs ``ids`` through kiln's runner in a sandbox's workspace.
    The runner's own deadline is ``timeout_s``; give the exec a little more.
    ``test_files`` (path -> text: the task's, as the clean room wrote them) are compiled
    by the runner before any workspace code runs, checked against their sha256."""
    spec = runner_spec(test_command)
    digests = {p: hashlib.sha256(t.encode()).hexdigest() for p, t in (test_files or {}).items()}
    config = json.dumps(
        {
            "framework": spec.framework,
            "ids": ids,
            "args": list(spec.args),
            "timeout_s": timeout_s,
            "test_files": digests,
        }
    )
    packed = base64.b64encode(zlib.compress(config.encode(), 9)).decode()
    if len(packed) > MAX_CONFIG_BYTES:
        raise UnsupportedTestCommand(
            f"{len(ids)} test ids are too many for one runner command ({len(packed)} bytes packed)"
        )
    return f"exec {shlex.quote(spec.python)} -I -S -c {shlex.quote(_runner_source())} {packed}"


class RunnerReport(BaseModel):
    """What the runner saw, as it wrote it (``runner.py``)."""

    kiln_runner: Literal[1]
    framework: Literal["unittest", "pytest"]
    count: int
    statuses: str = Field(pattern="^[PFESM]*$")
    """One letter per asked id, in order: Passed, Failed, Error, Skipped, Missing."""
    messages: dict[str, str] = Field(default_factory=dict)
    """Index of a test that did not pass -> the end of its failure message."""
    errors: list[tuple[str, str]] = Field(default_factory=list)
    """(where, message) of failures outside any test: an id that does not load, a
    collection error, a class fixture, the run itself stopping."""
    tampered: list[str] = Field(default_factory=list)
    shadowed: list[str] = Field(default_factory=list)
    """Standard-library module names the workspace's own modules took."""
    completed: bool
    """The child reached its end; False: it exited, crashed or was killed first."""
    timed_out: bool
    child_exit: int | None = None
    child_signal: int | None = None
    pytest_exit: int | None = None
    extra_results: int = 0
    problems: list[str] = Field(default_factory=list)
    """Events the runner refused (duplicates, malformed lines)."""
    python: str = ""
    seconds: float = 0.0


class ReportProblem(Exception):
    """The run left no usable report; the message says what was wrong."""


def read_report(stdout: str, ids: list[str], framework: str | None = None) -> RunnerReport:
    text = stdout.strip()
    if not text:
        raise ReportProblem("the runner wrote no report")
    try:
        report = RunnerReport.model_validate_json(text)
    except ValidationError as e:
        raise ReportProblem(f"the runner's report is not valid ({e.error_count()} errors: {str(e)[:300]})") from None
    if report.count != len(ids) or len(report.statuses) != len(ids):
        raise ReportProblem(f"the report covers {len(report.statuses)} tests, {len(ids)} were asked for")
    if framework is not None and report.framework != framework:
        raise ReportProblem(f"the report is of {report.framework}, {framework} was asked for")
    return report


_STATUS = {
    "P": CaseStatus.PASSED,
    "F": CaseStatus.FAILED,
    "E": CaseStatus.ERROR,
    "S": CaseStatus.SKIPPED,
    "M": CaseStatus.MISSING,
}


def case_statuses(report: RunnerReport, ids: list[str]) -> dict[str, CaseStatus]:
    return {test_id: _STATUS[letter] for test_id, letter in zip(ids, report.statuses)}
