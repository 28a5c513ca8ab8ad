"""Scoring a finished trajectory.

Invariants:
- the tests run against the trajectory's final workspace: its own sandbox, or, when that
  is gone, a fresh sandbox of the task with the trajectory's diff applied; the task's
  test files are written over it first (an agent cannot change its score by editing
  the tests);
- a failure of the infrastructure (no sandbox and no diff, env-pool down, the harness
  request timing out) yields ``infra_error`` with the cause, never a reward of 0; the
  agent's code hanging is not such a failure: the test command is killed at the task's
  timeout and its tests count as failed;
- scoring is idempotent: a redelivered trajectory whose record already exists is not
  re-run but republished from the record, and the ``Nats-Msg-Id`` dedupe keeps the
  learner from seeing it twice;
- every score is explainable: the record holds each reward term, every test's status
  and the head and tail of the output; the whole log is in the ``kiln-reward-logs``
  object store under ``log_key``.
"""

from __future__ import annotations

import logging
import shlex
import time

import nats.js.errors
from nats.js import api as js_api

from kiln.shared import contracts as c
from kiln.shared.bus import Delivery, RemoteError
from kiln.shared.db import Database, TrajectoryRecord
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.service import ServiceContext
from kiln.shared.tasks import Task, TaskSuite
from kiln.shared.tasks.report import outcome, parse_test_report
from kiln.shared.telemetry import trace_id_hex

from kiln.reward.config import RewardConfig
from kiln.reward.functions import TestResults, resolve, shaping

log = logging.getLogger("kiln.reward")

LOGS_BUCKET = "kiln-reward-logs"


class Scorer:
    def __init__(self, ctx: ServiceContext, db: Database, suite: TaskSuite):
        self.ctx = ctx
        self.cfg: RewardConfig = ctx.config  # type: ignore[assignment]
        self.db = db
        self.suite = suite
        self.envpool = EnvPoolClient(ctx.bus)
        self.reward_fn = resolve(self.cfg.reward.function)
        self.logs = None
        self.scored = 0

    async def start(self) -> None:
        js = self.ctx.bus.js
        try:
            self.logs = await js.object_store(LOGS_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            self.logs = await js.create_object_store(
                LOGS_BUCKET, config=js_api.ObjectStoreConfig(ttl=self.cfg.reward.logs_ttl_s, description="test logs")
            )

    async def on_trajectory(self, traj: c.Trajectory, delivery: Delivery) -> None:
        with self.ctx.tracer.start_as_current_span(
            "reward.score", attributes={"trajectory_id": traj.trajectory_id, "delivery": delivery.num_delivered}
        ) as span:
            async with self.db.session() as s:
                rec = await s.get(TrajectoryRecord, traj.trajectory_id)
            if rec is not None:
                log.info("%s was already scored; republishing its record", traj.trajectory_id)
                scored = c.ScoredTrajectory(
                    trajectory=traj,
                    reward=rec.reward or 0.0,
                    passed=rec.passed,
                    tests=rec.tests,
                    reward_terms=rec.reward_terms,
                    infra_error=rec.infra_error,
                    test_output=rec.test_output,
                )
            else:
                t0 = time.monotonic()
                scored, full_output = await self._score(traj)
                log_key = await self._store_log(traj.trajectory_id, full_output)
                await self._record(scored, log_key)
                m = self.ctx.metrics
                m.seconds.record(time.monotonic() - t0)
                m.scored.add(1, {"outcome": "infra_error" if scored.infra_error else "pass" if scored.passed else "fail"})
                if not scored.infra_error:
                    m.value.record(scored.reward)
            span.set_attribute("reward", scored.reward)
            span.set_attribute("infra_error", scored.infra_error or "")
            # Evaluation episodes go to their collector, never to the learner.
            subject = c.EVAL_SCORED if traj.purpose == "eval" else c.TRAJECTORY_SCORED
            await self.ctx.bus.publish(subject, scored, msg_id=traj.trajectory_id)
        if traj.sandbox and self.cfg.reward.destroy_sandbox:
            await self._destroy(traj.sandbox)
        self.scored += 1
        self.ctx.health_detail["scored"] = self.scored

    async def _destroy(self, ref: c.SandboxRef) -> None:
        try:
            await self.envpool.destroy(ref)
        except RemoteError as e:  # the lease reaper collects it
            log.warning("could not destroy %s: %s", ref.sandbox_id, e)

    async def _score(self, traj: c.Trajectory) -> tuple[c.ScoredTrajectory, str]:
        def infra(why: str) -> tuple[c.ScoredTrajectory, str]:
            return c.ScoredTrajectory(trajectory=traj, reward=0.0, passed=False, infra_error=why), ""

        if traj.status == c.TrajectoryStatus.INFRA_ERROR:
            return infra(traj.infra_error or "rollout reported an infrastructure error")
        task = self.suite.get(traj.task_id)
        rescored = False
        try:
            result = await self._run_tests(traj.sandbox, task) if traj.sandbox else None
        except RemoteError as e:
            if e.code != "not_found":
                return infra(f"test harness failed: {e}")
            result = None
        if result is None:  # the sandbox is gone (or never was): rebuild it from the diff
            if traj.final_diff is None:
                return infra("the trajectory's sandbox is gone and it carries no diff to rebuild it")
            try:
                result = await self._rescore_from_diff(traj, task)
            except RemoteError as e:
                return infra(f"rescoring in a fresh sandbox failed: {e}")
            rescored = True
        output = result.stdout + ("\n" if result.stdout else "") + result.stderr
        tests = outcome(parse_test_report(output), task.fail_to_pass + task.pass_to_pass)
        results = TestResults(tests, task.fail_to_pass, task.pass_to_pass, output, result.timed_out)
        terms = {"tests": float(self.reward_fn(traj, results))}
        terms.update(shaping(traj, self.cfg.reward.shaping))
        limit = self.cfg.reward.max_test_output_chars
        shown = output if len(output) <= limit else output[: limit // 2] + "\n[... cut ...]\n" + output[-limit // 2 :]
        scored = c.ScoredTrajectory(
            trajectory=traj,
            reward=sum(terms.values()),
            passed=results.all_passed,
            tests=tests,
            reward_terms=terms,
            rescored_from_diff=rescored,
            test_output=shown,
        )
        return scored, output

    async def _run_tests(self, ref: c.SandboxRef, task: Task) -> c.ExecResult:
        if task.test_files:
            calls = [
                c.ToolCall(id=f"restore-{i}", name="write_file", arguments={"path": p, "content": t})
                for i, (p, t) in enumerate(sorted(task.test_files.items()))
            ]
            for r in await self.envpool.tools(ref, calls):
                if r.error:
                    raise RemoteError("harness", f"could not restore test file: {r.error}")
        return await self.envpool.exec(ref, task.test_command, task.timeout_s)

    async def _rescore_from_diff(self, traj: c.Trajectory, task: Task) -> c.ExecResult:
        diff = traj.final_diff
        ref = await self.envpool.create(task.id, run_id=traj.run_id, ttl_s=task.timeout_s + 120)
        try:
            calls = [
                c.ToolCall(id=f"apply-{i}", name="write_file", arguments={"path": p, "content": t})
                for i, (p, t) in enumerate(sorted(diff.changed.items()))
            ]
            for r in await self.envpool.tools(ref, calls) if calls else []:
                if r.error:
                    raise RemoteError("harness", f"could not apply the diff: {r.error}")
            if diff.deleted:
                await self.envpool.exec(ref, "rm -f -- " + " ".join(shlex.quote(p) for p in diff.deleted), 30)
            return await self._run_tests(ref, task)
        finally:
            await self._destroy(ref)

    async def _store_log(self, trajectory_id: str, output: str) -> str:
        if not output or self.logs is None:
            return ""
        await self.logs.put(trajectory_id, output.encode())
        return trajectory_id

    async def _record(self, s: c.ScoredTrajectory, log_key: str) -> None:
        t = s.trajectory
        versions = t.generated_versions()
        async with self.db.session() as session:
            await session.merge(
                TrajectoryRecord(
                    trajectory_id=t.trajectory_id,
                    run_id=t.run_id,
                    group_id=t.group_id,
                    task_id=t.task_id,
                    sample_index=t.sample_index,
                    dispatch_version=t.dispatch_version,
                    min_version=min(versions) if versions else None,
                    max_version=max(versions) if versions else None,
                    reward=s.reward,
                    passed=s.passed,
                    infra_error=s.infra_error,
                    num_tokens=len(t.token_ids),
                    num_generated=len(versions),
                    num_turns=t.num_turns,
                    malformed_tool_calls=t.malformed_tool_calls,
                    finish_reason=t.finish_reason,
                    tests={k: v.value for k, v in s.tests.items()},
                    reward_terms=s.reward_terms,
                    test_output=s.test_output,
                    log_key=log_key,
                    messages=[m.model_dump(mode="json", by_alias=True) for m in t.messages],
                    trace_id=trace_id_hex(),
                    worker_id=t.worker_id,
                    purpose=t.purpose,
                    eval_id=t.eval_id,
                )
            )
