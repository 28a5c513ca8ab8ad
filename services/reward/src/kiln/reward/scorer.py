"""Scoring a finished trajectory.

Invariants:
- the tests run in a clean room (``cleanroom.py``): a fresh sandbox of the task with the
  trajectory's diff applied, protected paths reverted, the task's test files written
  last, and kiln's runner reporting the statuses; never in the agent's own sandbox, and
  never from text the tested code prints;
- ``infra_error`` is kept for kiln's machinery (no diff to rebuild from, env-pool down,
  the runner failing on the pristine repository); whatever the workspace's content does
  to its run is a ``Failure`` scored like failing tests;
- every task of the suite names a test command kiln's runner can run, or the service
  refuses to start (naming the tasks);
- scoring is idempotent: a redelivered trajectory whose record already exists is not
  re-run but republished from the record, and the ``Nats-Msg-Id`` dedupe keeps the
  learner from seeing it twice;
- every score is explainable: the record holds each reward term, every test's status,
  the failure and its detail, the integrity findings (protected paths touched,
  framework tampering, changes not reproduced), the runner's report and the head and
  tail of what the tests printed; the whole log is in the ``kiln-reward-logs`` object
  store under ``log_key``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from psycopg.errors import ForeignKeyViolation
from sqlalchemy.exc import DataError, IntegrityError

from kiln.reward.cleanroom import CleanRoom, InfraError, Verdict
from kiln.reward.config import RewardConfig
from kiln.reward.functions import TestResults, resolve, shaping
from kiln.shared import contracts as c
from kiln.shared.bus import Delivery, Reject, RemoteError
from kiln.shared.db import Database, TrajectoryRecord
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.service import ServiceContext
from kiln.shared.tasks import TaskSuite
from kiln.shared.tasks.testrun import UnsupportedTestCommand, runner_spec
from kiln.shared.telemetry import trace_id_hex

log = logging.getLogger("kiln.reward")

LOGS_BUCKET = "kiln-reward-logs"


class Scorer:
    def __init__(self, ctx: ServiceContext, db: Database, suite: TaskSuite):
        self.ctx = ctx
        self.cfg: RewardConfig = ctx.config  # type: ignore[assignment]
        self.db = db
        self.suite = suite
        self.envpool = EnvPoolClient(ctx.bus)
        self.room = CleanRoom(self.envpool, self.cfg.reward.harness_grace_s, self.cfg.reward.max_change_bytes)
        unsupported = []
        for task in suite.tasks:
            try:
                runner_spec(task.test_command)
            except UnsupportedTestCommand as e:
                unsupported.append(f"{task.id}: {e}")
        if unsupported:
            raise UnsupportedTestCommand(
                f"{len(unsupported)} tasks of {suite.source} cannot be scored: " + "; ".join(unsupported[:5])
            )
        self.reward_fn = resolve(self.cfg.reward.function)
        self.logs = None
        self.scored = 0

    async def start(self) -> None:
        self.logs = await self.ctx.bus.object_store(
            LOGS_BUCKET, ttl_s=self.cfg.reward.logs_ttl_s, description="test logs"
        )

    async def on_trajectory(self, traj: c.Trajectory, delivery: Delivery) -> None:
        # The agent's sandbox plays no part in the score once its diff is in hand: it goes
        # while the clean room runs (after scoring when the diff must be read from it).
        release = None
        if traj.sandbox and self.cfg.reward.destroy_sandbox and traj.final_diff is not None:
            release = asyncio.ensure_future(self._destroy(traj.sandbox))
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
                    failure=rec.failure,
                    failure_detail=rec.failure_detail,
                    integrity=c.Integrity.model_validate(rec.integrity or {}),
                    report=rec.report,
                    test_output=rec.test_output,
                )
            else:
                t0 = time.monotonic()
                scored, full_output = await self._score(traj)
                log_key = await self._store_log(traj.trajectory_id, full_output)
                try:
                    await self._record(scored, log_key)
                except (
                    DataError
                ) as e:  # an id too long, a number out of range (text is cleaned: db/types.py): retrying cannot help
                    raise Reject(f"cannot record {traj.trajectory_id[:200]!r}: {e.orig}") from None
                except IntegrityError as e:
                    # A run that has no row never will (the controller writes it before any
                    # dispatch); a duplicate key, by contrast, is a replica racing us: retry.
                    if isinstance(e.orig, ForeignKeyViolation):
                        raise Reject(f"cannot record {traj.trajectory_id[:200]!r}: {e.orig}") from None
                    raise
                m = self.ctx.metrics
                m.seconds.record(time.monotonic() - t0)
                outcome = "infra_error" if scored.infra_error else "pass" if scored.passed else scored.failure.value
                m.scored.add(1, {"outcome": outcome, "touched_protected": bool(scored.integrity.protected)})
                if not scored.infra_error:
                    m.value.record(scored.reward)
            span.set_attribute("reward", scored.reward)
            span.set_attribute("infra_error", scored.infra_error or "")
            # Evaluation episodes go to their collector, never to the learner.
            subject = c.EVAL_SCORED if traj.purpose == "eval" else c.TRAJECTORY_SCORED
            await self.ctx.bus.publish(subject, scored, msg_id=traj.trajectory_id)
        if release is not None:
            await release
        elif traj.sandbox and self.cfg.reward.destroy_sandbox:
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
        try:
            task = self.suite.get(traj.task_id)
        except KeyError as e:  # no test to run it against: retrying cannot help
            raise Reject(str(e)) from None
        if traj.finish_reason in c.HARNESS_FAILURES:  # nothing to test: a failure, never an escape from one
            ids = task.fail_to_pass + task.pass_to_pass
            verdict = Verdict(
                {t: c.CaseStatus.MISSING for t in ids},
                c.Failure.HARNESS,
                f"the harness ended with {traj.finish_reason}: {traj.harness_log[-300:]}",
            )
        else:
            try:
                verdict = await self.room.judge(traj, task)
            except InfraError as e:
                return infra(str(e))
        results = TestResults(verdict.tests, task.fail_to_pass, task.pass_to_pass, verdict.output, verdict.timed_out)
        terms = {"tests": 0.0 if verdict.zeroes_tests else float(self.reward_fn(traj, results))}
        terms.update(shaping(traj, self.cfg.reward.shaping))
        output = verdict.output
        limit = self.cfg.reward.max_test_output_chars
        shown = output if len(output) <= limit else output[: limit // 2] + "\n[... cut ...]\n" + output[-limit // 2 :]
        scored = c.ScoredTrajectory(
            trajectory=traj,
            reward=sum(terms.values()),
            passed=verdict.failure is None,
            tests=verdict.tests,
            reward_terms=terms,
            rescored_from_diff=True,
            failure=verdict.failure,
            failure_detail=verdict.detail,
            integrity=verdict.integrity,
            report=verdict.report.model_dump() if verdict.report is not None else None,
            test_output=shown,
        )
        return scored, output

    async def _store_log(self, trajectory_id: str, output: str) -> str:
        if not output or self.logs is None:
            return ""
        await self.logs.put(
            trajectory_id, output.encode(errors="surrogatepass")
        )  # every character kept, whatever it is
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
                    failure=s.failure.value if s.failure else None,
                    failure_detail=s.failure_detail,
                    touched_protected=bool(s.integrity.protected),
                    tampered=bool(s.integrity.tampered),
                    integrity=s.integrity.model_dump(),
                    report=s.report,
                    log_key=log_key,
                    messages=[m.model_dump(mode="json", by_alias=True) for m in t.messages],
                    trace_id=trace_id_hex(),
                    worker_id=t.worker_id,
                    purpose=t.purpose,
                    eval_id=t.eval_id,
                )
            )
