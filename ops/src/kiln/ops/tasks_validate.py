"""``kiln tasks validate``: check each task of a suite in its environment (project issue 22).

For every task, two runs of its tests through kiln's runner (exactly as reward runs
them: ``kiln.shared.tasks.testrun``) in a throwaway writable copy of the
workspace (the environment's repository layer, the task's ``files`` over it, its
``test_files`` written last), bound at ``/workspace`` over the environment's read-only
layers with ``environment_bwrap_args``: no network, ``task.timeout_s``.

- ``unchanged``: every FAIL_TO_PASS test fails (failed, error or not reported) and every
  PASS_TO_PASS test passes;
- ``solution``: with the reference ``solution`` written over the files (and the test files
  written again, as the reward does before scoring), every one of them passes;
- ``imports``: in the unchanged workspace, the repository's own top-level modules that the
  test files import (``kiln.shared.tasks.testdeps.tested_modules``) are imported by a probe
  test run through kiln's runner like the task's tests (``PROBE_SOURCE``: it fails with the
  files they came from); each must come from under ``/workspace``. One that resolves elsewhere (a copy of the same distribution that a
  dependency pulled from the index into the venv) rejects the task: its tests would
  exercise that copy, not the repository.

A task without an environment runs on the host system (its ``/usr`` read-only, as plain
sandboxes do) over a workspace holding only its files. An environment that cannot be
built rejects its tasks without running them, naming the environment and the step.
This is validation, not the hot path: the workspace is a plain copy.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.envpool.environments.cache import EnvironmentCache
from kiln.envpool.environments.layers import BuiltEnvironment, EnvironmentBuildError
from kiln.envpool.environments.sandbox import environment_bwrap_args
from kiln.shared.contracts import CaseStatus
from kiln.shared.environments import WORKSPACE
from kiln.shared.tasks import Task, TaskSuite, write_suite_file
from kiln.shared.tasks.testdeps import DirTree, tested_modules
from kiln.shared.tasks.testrun import (
    ReportProblem,
    UnsupportedTestCommand,
    case_statuses,
    read_report,
    runner_command,
    runner_spec,
)

HOST = BuiltEnvironment(name="host", digest="", host_base=True, layers=())
"""What a task without an environment runs in: the host's system, an empty workspace."""
TAIL_CHARS = 1500
PROBE_MODULE = "test_kiln_where_probe"
PROBE_SOURCE = """import json
import sys
import unittest

NAMES = {names!r}


def _where():
    found = {{}}
    for name in NAMES:
        try:
            __import__(name)
            found[name] = getattr(sys.modules[name], "__file__", None) or str(list(getattr(sys.modules[name], "__path__", []))[:1])
        except Exception as e:
            found[name] = None
    return "KILN-WHERE " + json.dumps(found) + " KILN-END"


def test_where():
    raise AssertionError(_where())


class KilnWhere(unittest.TestCase):
    def test_where(self):
        raise AssertionError(_where())
"""
"""A test that fails with where the repository's own modules came from, run through
kiln's runner exactly as the task's tests are (so it sees what they see, whatever the
runner imports first)."""


@dataclass
class PhaseRun:
    phase: str
    """``unchanged`` or ``solution``."""
    returncode: int | None
    timed_out: bool
    output: str
    tests: dict[str, CaseStatus]
    seconds: float
    problem: str | None = None
    """The runner gave no usable report, or found the framework tampered with."""


@dataclass
class Verdict:
    task_id: str
    ok: bool
    reasons: list[str] = field(default_factory=list)
    """Why the task is rejected, one line each (phase, test, what was expected)."""
    output_tail: str = ""
    """The tail of the output of the phase that rejected it."""
    environment_error: str | None = None
    runs: list[PhaseRun] = field(default_factory=list)
    seconds: float = 0.0
    imports: dict[str, str | None] = field(default_factory=dict)
    """The repository's own modules the tests import -> the file they resolve to in the
    environment (None: not importable)."""

    def describe(self) -> str:
        if self.ok:
            where = "; ".join(f"{m} from {w}" for m, w in self.imports.items())
            return f"ok {self.task_id} ({self.seconds:.1f}s{'; the tests import ' + where if where else ''})"
        lines = [f"REJECTED {self.task_id}"] + [f"  {r}" for r in self.reasons]
        if self.output_tail:
            lines.append("  output tail:")
            lines += [f"    | {x}" for x in self.output_tail.splitlines()]
        return "\n".join(lines)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        if p.is_symlink() or (p.exists() and not p.is_file()):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def prepare_workspace(built: BuiltEnvironment, task: Task, dest: Path, solution: bool = False) -> Path:
    """A writable copy of the environment's repository with the task's files, the solution
    (when asked) and the test files written over it, in that order."""
    repo = built.layer("repository")
    src = repo.path / WORKSPACE.lstrip("/") if repo is not None else None
    if src is not None and src.is_dir():
        shutil.copytree(src, dest, symlinks=True)
    else:
        dest.mkdir(parents=True)
    _write(dest, task.files)
    if solution and task.solution:
        _write(dest, task.solution)
    _write(dest, task.test_files)
    return dest


async def run_tests(
    built: BuiltEnvironment, workspace: Path, command: str, timeout_s: float, env: dict[str, str] | None = None
) -> tuple[int | None, bool, str, float]:
    """Run ``command`` (bash) in ``built`` over ``workspace``: (returncode, timed out,
    stdout+stderr, seconds). No network."""
    rc, timed_out, out, _, seconds = await run_command(built, workspace, command, timeout_s, env, merge=True)
    return rc, timed_out, out, seconds


async def run_command(
    built: BuiltEnvironment,
    workspace: Path,
    command: str,
    timeout_s: float,
    env: dict[str, str] | None = None,
    merge: bool = False,
) -> tuple[int | None, bool, str, str, float]:
    """(returncode, timed out, stdout, stderr, seconds) of ``command`` (bash) in ``built``
    over ``workspace``; ``merge`` sends stderr to stdout."""
    argv = environment_bwrap_args(built, ["bash", "-c", command], workspace=workspace, env=env)
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT if merge else asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        return (
            proc.returncode,
            False,
            out.decode(errors="replace"),
            (err or b"").decode(errors="replace"),
            time.monotonic() - t0,
        )
    except TimeoutError:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        out = err = b""
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 10)
        except TimeoutError:
            pass
        return None, True, out.decode(errors="replace"), (err or b"").decode(errors="replace"), time.monotonic() - t0


def _tested_modules(task: Task, ws: Path) -> list[str]:
    sources = list(task.test_files.values())
    if not sources:
        for path in dict.fromkeys(t.split("::", 1)[0] for t in task.fail_to_pass + task.pass_to_pass if "::" in t):
            if (ws / path).is_file():
                sources.append((ws / path).read_text(errors="replace"))
    return tested_modules(DirTree(ws), sources)


async def locate_imports(built: BuiltEnvironment, task: Task, ws: Path) -> dict[str, str | None]:
    """The repository's own modules that the task's tests import -> the file they are
    loaded from when a test imports them under kiln's runner in ``built`` over ``ws``
    (None: not importable); empty when the tests import none of them or the test command
    is no runner's."""
    names = await asyncio.to_thread(_tested_modules, task, ws)
    try:
        spec = runner_spec(task.test_command)
    except UnsupportedTestCommand:
        return {}
    if not names:
        return {}
    ids = [t for t in task.fail_to_pass + task.pass_to_pass if "::" in t]
    folder = ids[0].split("::", 1)[0].rpartition("/")[0] if spec.framework == "pytest" and ids else ""
    probe = f"{folder}/{PROBE_MODULE}.py" if folder else f"{PROBE_MODULE}.py"
    (ws / probe).write_text(PROBE_SOURCE.format(names=names))
    probe_id = f"{probe}::test_where" if spec.framework == "pytest" else f"{PROBE_MODULE}.KilnWhere.test_where"
    command = runner_command(task.test_command, [probe_id], 120)
    _, _, stdout, stderr, _ = await run_command(built, ws, command, 135)
    try:
        report = read_report(stdout, [probe_id])
        text = "\n".join([*report.messages.values(), *(str(e) for e in report.errors)])
    except ReportProblem:
        text = stderr
    m = re.search(r"KILN-WHERE (\{.*?\}) KILN-END", text)
    try:
        found = json.loads(m.group(1)) if m else {}
    except ValueError:
        found = {}
    return {n: (os.path.normpath(found[n]) if found.get(n) else None) for n in names}


def judge_imports(imports: dict[str, str | None]) -> list[str]:
    """Reasons a task's imports reject it: an own module found outside the workspace."""
    return [
        f"imports: the tests import {name} from {where}, not from the repository's files under {WORKSPACE}: "
        "a copy of the same distribution in the environment (installed from the index, e.g. as a dependency "
        "of the test requirements) shadows the repository, so the tests would not exercise its code; install "
        "the project (python.install_project = true, resolved together with the test requirements) or put "
        "its source folder on the path"
        for name, where in imports.items()
        if where and not (where + "/").startswith(WORKSPACE + "/")
    ]


async def run_phase(
    built: BuiltEnvironment, task: Task, phase: str, scratch: Path, imports: dict[str, str | None] | None = None
) -> PhaseRun:
    """One phase through kiln's runner, as reward runs it (``testrun.runner_command``): the
    statuses come from its report, the output is what the tests printed. ``imports``, when
    given, is filled with ``locate_imports`` over the same workspace after the run."""
    ws = await asyncio.to_thread(prepare_workspace, built, task, scratch / phase, phase == "solution")
    ids = task.fail_to_pass + task.pass_to_pass
    try:
        command = runner_command(task.test_command, ids, task.timeout_s, task.test_files)
    except UnsupportedTestCommand as e:
        await asyncio.to_thread(shutil.rmtree, ws, True)
        return PhaseRun(phase, None, False, str(e), {t: CaseStatus.MISSING for t in ids}, 0.0, problem=str(e))
    try:
        rc, _, stdout, stderr, seconds = await run_command(built, ws, command, task.timeout_s + 15)
        if imports is not None:
            imports.update(await locate_imports(built, task, ws))
    finally:
        await asyncio.to_thread(shutil.rmtree, ws, True)
    try:
        report = read_report(stdout, ids)
    except ReportProblem as e:
        return PhaseRun(phase, rc, False, stderr, {t: CaseStatus.MISSING for t in ids}, seconds, problem=str(e))
    problem = "the tests tampered with " + ", ".join(report.tampered) if report.tampered else None
    return PhaseRun(phase, rc, report.timed_out, stderr, case_statuses(report, ids), seconds, problem=problem)


def _tail(text: str, n: int = TAIL_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def judge(task: Task, run: PhaseRun) -> list[str]:
    """Reasons the phase's results reject the task (empty: as expected)."""
    reasons = []
    if run.timed_out:
        return [f"{run.phase}: the tests timed out after {task.timeout_s:g}s"]
    if run.problem:
        return [f"{run.phase}: {run.problem}"]
    for t in task.fail_to_pass:
        s = run.tests[t]
        if run.phase == "unchanged" and s == CaseStatus.PASSED:
            reasons.append(f"unchanged: FAIL_TO_PASS test {t} passes before the fix (it must fail)")
        elif run.phase == "solution" and s != CaseStatus.PASSED:
            reasons.append(f"solution: FAIL_TO_PASS test {t} is {s.value} with the reference solution (it must pass)")
    for t in task.pass_to_pass:
        s = run.tests[t]
        if s != CaseStatus.PASSED:
            where = "before the fix" if run.phase == "unchanged" else "with the reference solution"
            reasons.append(f"{run.phase}: PASS_TO_PASS test {t} is {s.value} {where} (it must pass)")
    return reasons


async def validate_task(built: BuiltEnvironment, task: Task, scratch_root: Path | None = None) -> Verdict:
    t0 = time.monotonic()
    verdict = Verdict(task.id, ok=True)
    with tempfile.TemporaryDirectory(prefix="kiln-validate-", dir=scratch_root) as scratch:
        phases = ["unchanged", "solution"] if task.solution is not None else ["unchanged"]
        for phase in phases:
            run = await run_phase(built, task, phase, Path(scratch), verdict.imports if phase == "unchanged" else None)
            verdict.runs.append(run)
            reasons = (judge_imports(verdict.imports) if phase == "unchanged" else []) + judge(task, run)
            if reasons:
                verdict.ok = False
                verdict.reasons += reasons
                verdict.output_tail = _tail(run.output)
                break
    if task.solution is None and verdict.ok:
        verdict.reasons.append("no reference solution: only the unchanged repository was checked")
    verdict.seconds = time.monotonic() - t0
    return verdict


async def validate_suite(
    suite: TaskSuite,
    cache: EnvironmentCache,
    task_ids: list[str] | None = None,
    jobs: int = 2,
    on_verdict: Callable[[Verdict], None] | None = None,
    scratch_root: Path | None = None,
) -> list[Verdict]:
    """Validate the tasks (all, or ``task_ids``) of ``suite``, ``jobs`` at a time; each
    environment is built (or found in ``cache``) once. Verdicts in the suite's order."""
    tasks = [suite.get(t) for t in task_ids] if task_ids else list(suite.tasks)
    built: dict[str, BuiltEnvironment | EnvironmentBuildError] = {}
    for name in dict.fromkeys(t.environment for t in tasks if t.environment):
        try:
            built[name] = await cache.get(suite.environments[name])
        except EnvironmentBuildError as e:
            built[name] = e
    sem = asyncio.Semaphore(max(1, jobs))

    async def one(task: Task) -> Verdict:
        env = built[task.environment] if task.environment else HOST
        if isinstance(env, EnvironmentBuildError):
            v = Verdict(
                task.id,
                ok=False,
                reasons=[f"environment {env.environment!r} cannot be built: {env.step} step failed"],
                output_tail=_tail(env.reason),
                environment_error=str(env),
            )
        else:
            async with sem:
                v = await validate_task(env, task, scratch_root)
        if on_verdict is not None:
            on_verdict(v)
        return v

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def write_valid(suite: TaskSuite, task_ids: list[str], out: str | Path) -> Path:
    """The valid tasks as JSONL at ``out``; when they name environments, a TOML suite beside
    it (``<out>.toml``) declaring them, which is then what to load."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tasks = [suite.get(t) for t in task_ids]
    out.write_text("".join(t.model_dump_json() + "\n" for t in tasks))
    names = list(dict.fromkeys(t.environment for t in tasks if t.environment))
    if not names:
        return out
    return write_suite_file(out.with_suffix(".toml"), out.name, [suite.environments[n] for n in names])
