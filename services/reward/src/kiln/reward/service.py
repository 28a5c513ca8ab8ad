"""Scoring a finished trajectory.

Invariants:
- the tests run against the trajectory's own final workspace, with the task's test
  files written over it first (an agent cannot change its score by editing tests);
- a failure of the infrastructure (no sandbox, sandbox lost, env-pool down, the harness
  request timing out) yields ``infra_error`` with the cause, never a reward of 0; the
  agent's code hanging is not such a failure: the test command is killed at the task's
  timeout and its tests count as failed;
- scoring is idempotent: a redelivered trajectory whose record already exists is not
  re-run (its sandbox may be gone) but republished from the record, and the
  ``Nats-Msg-Id`` dedupe keeps the learner from seeing it twice.
"""

from __future__ import annotations

import logging

from kiln.shared import contracts as c
from kiln.shared.bus import Delivery, RemoteError
from kiln.shared.db import Database, TrajectoryRecord
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.service import ServiceContext
from kiln.shared.tasks import TaskSuite
from kiln.shared.telemetry import trace_id_hex

from kiln.reward.config import RewardConfig
from kiln.reward.scoring import score

log = logging.getLogger("kiln.reward")


class Scorer:
    def __init__(self, ctx: ServiceContext, db: Database, suite: TaskSuite):
        self.ctx = ctx
        self.cfg: RewardConfig = ctx.config  # type: ignore[assignment]
        self.db = db
        self.suite = suite
        self.envpool = EnvPoolClient(ctx.bus)
        self.scored = 0

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
                    infra_error=rec.infra_error,
                    test_output=rec.test_output,
                )
            else:
                scored = await self._score(traj)
                await self._record(scored)
            span.set_attribute("reward", scored.reward)
            span.set_attribute("infra_error", scored.infra_error or "")
            await self.ctx.bus.publish(c.TRAJECTORY_SCORED, scored, msg_id=traj.trajectory_id)
        if traj.sandbox and self.cfg.reward.destroy_sandbox:
            try:
                await self.envpool.destroy(traj.sandbox)
            except RemoteError as e:  # the lease reaper collects it
                log.warning("could not destroy %s: %s", traj.sandbox.sandbox_id, e)
        self.scored += 1
        self.ctx.health_detail["scored"] = self.scored

    async def _score(self, traj: c.Trajectory) -> c.ScoredTrajectory:
        infra = lambda why: c.ScoredTrajectory(trajectory=traj, reward=0.0, passed=False, infra_error=why)  # noqa: E731
        if traj.status == c.TrajectoryStatus.INFRA_ERROR:
            return infra(traj.infra_error or "rollout reported an infrastructure error")
        if traj.sandbox is None:
            return infra("trajectory has no sandbox to score")
        task = self.suite.get(traj.task_id)
        try:
            if task.test_files:
                calls = [
                    c.ToolCall(id=f"restore-{i}", name="write_file", arguments={"path": p, "content": t})
                    for i, (p, t) in enumerate(sorted(task.test_files.items()))
                ]
                for r in await self.envpool.tools(traj.sandbox, calls):
                    if r.error:
                        return infra(f"could not restore test file: {r.error}")
            result = await self.envpool.exec(traj.sandbox, task.test_command, task.timeout_s)
        except RemoteError as e:
            return infra(f"test harness failed: {e}")
        output = result.stdout + ("\n" if result.stdout else "") + result.stderr
        reward, passed, tests = score(task, output, self.cfg.reward.function)
        limit = self.cfg.reward.max_test_output_chars
        if len(output) > limit:
            output = output[: limit // 2] + "\n[... cut ...]\n" + output[-limit // 2 :]
        return c.ScoredTrajectory(trajectory=traj, reward=reward, passed=passed, tests=tests, test_output=output)

    async def _record(self, s: c.ScoredTrajectory) -> None:
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
                    test_output=s.test_output,
                    messages=[m.model_dump(mode="json", by_alias=True) for m in t.messages],
                    trace_id=trace_id_hex(),
                    worker_id=t.worker_id,
                )
            )

