"""The clean room: a trajectory's tests, run where its workspace cannot reach the judge.

Every score is decided in a fresh sandbox of the task (its environment, its pristine
repository and files), never in the sandbox the agent worked in:

1. the trajectory's diff (``final_diff``, or asked of env-pool while its sandbox lives)
   is split by ``protect.plan``: changes to protected paths (the task's test folders and
   files, test configuration, what the task marks) are left out and recorded; links,
   binaries and modes are not reproduced (recorded too);
2. the remaining text changes are written with env-pool's file tools, deletions made,
   and the task's ``test_files`` written last;
3. kiln's runner (``kiln.shared.tasks.runner``) runs the task's ids with an isolated
   interpreter and hands back a structured report on a channel the tests do not hold.

Invariants:
- a score never comes from text the tested code can print or from a file it can write:
  statuses come from the runner's report only; what the tests printed is kept for
  people (``output``);
- anything the workspace's content causes (a change that cannot be written, a full
  quota, tests that hang, exit early, kill their runner or patch the framework, a diff
  env-pool marked ``truncated``, thousands of config files to compare) is a
  ``Failure`` with its reason, never ``infra_error``, and every command the room sends
  stays under the length one command may have (paths go in batches); ``infra_error`` (``InfraError``)
  is kept for kiln's own machinery: env-pool unreachable or refusing, a sandbox lost,
  no diff to rebuild from, or the runner failing on the task's pristine repository
  (checked once per task, the first time a run leaves no report);
- the clean room is destroyed whatever happens (in the background: scoring does not
  wait for the teardown).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import shlex
from dataclasses import dataclass, field

from kiln.shared import contracts as c
from kiln.shared.bus import RemoteError
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.tasks import Task
from kiln.shared.tasks.protect import CleanRoomPlan, plan, protection, revert_config_changes
from kiln.shared.tasks.testrun import (
    ReportProblem,
    RunnerReport,
    UnsupportedTestCommand,
    case_statuses,
    read_report,
    runner_command,
    runner_spec,
)

log = logging.getLogger("kiln.reward.cleanroom")

ROOM_TTL_GRACE_S = 120.0
"""A clean room's lease beyond its test timeout (the lease reaper's backstop)."""


DELETE_BATCH_CHARS = 64 * 1024


UNREADABLE = "\0 a pristine file kiln could not read whole"
"""Stands for a pristine config file's text that did not come back whole: no change equals it."""


def _batches(words: list[str]) -> list[list[str]]:
    """``words`` in runs of at most ``DELETE_BATCH_CHARS`` characters (one command each)."""
    out: list[list[str]] = []
    size = DELETE_BATCH_CHARS
    for w in words:
        if size + len(w) + 1 > DELETE_BATCH_CHARS:
            out.append([])
            size = 0
        out[-1].append(w)
        size += len(w) + 1
    return out


class InfraError(Exception):
    """kiln's machinery could not score the trajectory (the message says what failed)."""


@dataclass
class Verdict:
    """A clean room's outcome: statuses of the task's ids, why it did not pass, and what
    the room found on the way."""

    tests: dict[str, c.CaseStatus]
    failure: c.Failure | None
    detail: str = ""
    integrity: c.Integrity = field(default_factory=c.Integrity)
    report: RunnerReport | None = None
    output: str = ""
    timed_out: bool = False

    @property
    def zeroes_tests(self) -> bool:
        """Failures that void the test statuses (a partial-credit reward gets nothing)."""
        return self.failure not in (None, c.Failure.TESTS_FAILED)


class CleanRoom:
    def __init__(self, envpool: EnvPoolClient, grace_s: float, max_change_bytes: int):
        self.envpool = envpool
        self.grace_s = grace_s
        self.max_change_bytes = max_change_bytes
        self.pristine_ok: set[str] = set()
        """Tasks whose runner gave a report on the pristine repository (checked on demand)."""
        self._teardowns: set[asyncio.Task] = set()

    async def judge(self, traj: c.Trajectory, task: Task) -> Verdict:
        diff = await self._diff(traj)
        room_plan = plan(protection(list(task.test_files), task.protected), diff)
        if diff.truncated:  # the workspace cannot be rebuilt from it: the trajectory's own doing
            integrity = c.Integrity(protected=dict(room_plan.protected), not_reproduced=room_plan.not_reproduced)
            return self._not_run(
                task, c.Failure.NOT_APPLIED, f"the workspace's diff is incomplete: {diff.truncated}", integrity
            )
        ref = await self._create(task, traj.run_id)
        try:
            return await self._run(ref, task, room_plan, traj.run_id)
        finally:
            self._destroy_later(ref)

    async def _diff(self, traj: c.Trajectory) -> c.WorkspaceDiff:
        if traj.final_diff is not None:
            return traj.final_diff
        if traj.sandbox is not None:
            try:
                return await self.envpool.diff(traj.sandbox)
            except RemoteError as e:
                if e.code != "not_found":
                    raise InfraError(f"could not read the trajectory's diff from env-pool: {e}") from None
        raise InfraError("the trajectory's sandbox is gone and it carries no diff to rebuild it")

    async def _create(self, task: Task, run_id: str) -> c.SandboxRef:
        try:
            return await self.envpool.create(task.id, run_id=run_id, ttl_s=task.timeout_s + ROOM_TTL_GRACE_S)
        except RemoteError as e:
            raise InfraError(f"could not create the clean room: {e}") from None

    async def _run(self, ref: c.SandboxRef, task: Task, room: CleanRoomPlan, run_id: str) -> Verdict:
        integrity = c.Integrity(protected={}, not_reproduced=room.not_reproduced)
        try:
            if room.config_checks:
                revert_config_changes(room, await self._read(ref, room.config_checks))
            integrity.protected = dict(room.protected)
            problem = await self._apply(ref, task, room)
            if problem:
                return self._not_run(task, c.Failure.NOT_APPLIED, problem, integrity)
            ids = task.fail_to_pass + task.pass_to_pass
            result = await self.envpool.exec(
                ref,
                runner_command(task.test_command, ids, task.timeout_s, task.test_files),
                task.timeout_s + self.grace_s,
            )
        except RemoteError as e:
            raise InfraError(f"the clean room failed: {e}") from None
        except UnsupportedTestCommand as e:  # the task's, not the trajectory's (too many ids)
            raise InfraError(f"task {task.id} cannot be run by kiln's runner: {e}") from None
        output = result.stderr
        try:
            report = read_report(result.stdout, ids, runner_spec(task.test_command).framework)
        except ReportProblem as e:
            await self._check_pristine(task, run_id)
            why = f"{e} (runner exit {result.exit_code}{', killed at the timeout' if result.timed_out else ''}): {output[-300:]}"
            return self._not_run(task, c.Failure.NO_REPORT, why, integrity, output, result.timed_out)
        integrity.tampered, integrity.shadowed = report.tampered, report.shadowed
        tests = case_statuses(report, ids)
        verdict = Verdict(tests, None, "", integrity, report, output, report.timed_out)
        if report.tampered:
            verdict.failure, verdict.detail = (
                c.Failure.TAMPERED,
                "the tests' code replaced " + ", ".join(report.tampered),
            )
        elif report.timed_out:
            verdict.failure, verdict.detail = c.Failure.TIMEOUT, f"the test run passed its {task.timeout_s:g}s timeout"
        elif not report.completed:
            how = (
                f"signal {report.child_signal}" if report.child_signal is not None else f"exit code {report.child_exit}"
            )
            last = "; ".join(f"{w}: {m}" for w, m in report.errors[-2:])
            verdict.failure, verdict.detail = (
                c.Failure.INCOMPLETE,
                f"the test process ended early ({how}){': ' + last if last else ''}",
            )
        elif any(s != c.CaseStatus.PASSED for s in tests.values()):
            bad = [t for t, s in tests.items() if s != c.CaseStatus.PASSED]
            verdict.failure, verdict.detail = (
                c.Failure.TESTS_FAILED,
                f"{len(bad)} of {len(ids)} tests did not pass: {', '.join(bad[:5])}",
            )
        elif integrity.protected and task.protected_touch == "fail":
            verdict.failure, verdict.detail = (
                c.Failure.PROTECTED,
                "changed protected paths: " + ", ".join(sorted(integrity.protected)[:5]),
            )
        return verdict

    @staticmethod
    def _not_run(
        task: Task, failure: c.Failure, detail: str, integrity: c.Integrity, output: str = "", timed_out=False
    ) -> Verdict:
        ids = task.fail_to_pass + task.pass_to_pass
        return Verdict({t: c.CaseStatus.MISSING for t in ids}, failure, detail, integrity, None, output, timed_out)

    async def _read(self, ref: c.SandboxRef, paths: list[str]) -> dict[str, str | None]:
        """The pristine text of ``paths`` in the fresh room (None: the task has none), read
        in commands of bounded length (a diff may name thousands of config files); a file
        whose text does not come back whole reads as ``UNREADABLE`` (any change to it counts)."""
        out: dict[str, str | None] = dict.fromkeys(paths)
        quoted = {shlex.quote(p): p for p in paths}
        for batch in _batches(list(quoted)):  # batched as quoted: the command line's real length
            for name, text in (await self._read_batch(ref, [quoted[q] for q in batch])).items():
                out[name] = text
        return out

    async def _read_batch(self, ref: c.SandboxRef, paths: list[str]) -> dict[str, str | None]:
        quoted = " ".join(shlex.quote(p) for p in paths)
        script = f'for f in {quoted}; do if [ -f "$f" ]; then printf \'%s\\0\' "$f"; base64 -w0 < "$f"; printf \'\\0\'; fi; done'
        res = await self.envpool.exec(ref, script, 30)
        if res.truncated and len(paths) > 1:  # more than one command's output holds: one file at a time
            out: dict[str, str | None] = {}
            for p in paths:
                out.update(await self._read_batch(ref, [p]))
            return out
        out = dict.fromkeys(paths)
        parts = res.stdout.split("\0")
        for name, data in zip(parts[0::2], parts[1::2]):
            if name in out:
                try:
                    out[name] = (
                        UNREADABLE if res.truncated else base64.b64decode(data, validate=True).decode(errors="replace")
                    )
                except binascii.Error:
                    out[name] = UNREADABLE
        return out

    async def _apply(self, ref: c.SandboxRef, task: Task, room: CleanRoomPlan) -> str:
        """Write the trajectory's changes, then the task's test files; '' when all went in,
        else what the workspace's content refused."""
        size = sum(len(t.encode()) for t in room.changed.values())
        if size > self.max_change_bytes:
            return f"the changes hold {size} bytes of text, more than the {self.max_change_bytes} a clean room takes"
        for batch in _batches([shlex.quote(p) for p in room.deleted]):  # a command line has a size limit
            res = await self.envpool.exec(ref, "rm -rf -- " + " ".join(batch), 60)
            if res.exit_code != 0:
                return f"could not delete {', '.join(room.deleted[:5])}: {(res.stderr or res.stdout)[-300:]}"
        calls = [
            c.ToolCall(id=f"apply-{i}", name="write_file", arguments={"path": p, "content": t})
            for i, (p, t) in enumerate(sorted(room.changed.items()))
        ]
        calls += [
            c.ToolCall(id=f"tests-{i}", name="write_file", arguments={"path": p, "content": t})
            for i, (p, t) in enumerate(sorted(task.test_files.items()))
        ]
        for call, r in zip(calls, await self.envpool.tools(ref, calls) if calls else []):
            if r.error:
                what = "the change to" if call.id.startswith("apply") else "the task's test file"
                return f"could not write {what} {call.arguments['path']}: {r.error}"
        return ""

    async def _check_pristine(self, task: Task, run_id: str) -> None:
        """Raise ``InfraError`` unless the runner reports on the task's pristine repository."""
        if task.id in self.pristine_ok:
            return
        ref = await self._create(task, run_id)
        try:
            if await self._apply(ref, task, CleanRoomPlan()):
                raise InfraError(f"kiln cannot write task {task.id}'s test files into its pristine repository")
            ids = task.fail_to_pass + task.pass_to_pass
            res = await self.envpool.exec(
                ref,
                runner_command(task.test_command, ids, task.timeout_s, task.test_files),
                task.timeout_s + self.grace_s,
            )
            read_report(res.stdout, ids)
        except ReportProblem as e:
            raise InfraError(
                f"kiln's test runner fails on task {task.id}'s pristine repository: {e}: {res.stderr[-300:]}"
            ) from None
        except RemoteError as e:
            raise InfraError(f"checking the runner on the pristine repository failed: {e}") from None
        finally:
            self._destroy_later(ref)
        self.pristine_ok.add(task.id)

    def _destroy_later(self, ref: c.SandboxRef) -> None:
        t = asyncio.ensure_future(self._destroy(ref))
        self._teardowns.add(t)
        t.add_done_callback(self._teardowns.discard)

    async def _destroy(self, ref: c.SandboxRef) -> None:
        try:
            await self.envpool.destroy(ref)
        except RemoteError as e:  # the lease reaper collects it
            log.warning("could not destroy clean room %s: %s", ref.sandbox_id, e)

    async def close(self) -> None:
        if self._teardowns:
            await asyncio.gather(*self._teardowns, return_exceptions=True)
