"""The controller: the one place that decides what work exists.

It dispatches groups, drops the ones that can no longer train, and ends the run: it is
the only place that does (``finish_run``), and the run's result is its ``RunOutcome``.
The trainer sees it only through ``kiln.learner.ledger.TrainerLedger``.

Invariants:
- the run ends once, here: when version ``algorithm.steps`` is published (after the
  trainer has finished the step that produced it, and its evaluation), when more groups
  failed than ``learner.max_dropped_groups``, or when a drop leaves no task to dispatch;
  ``outcome`` says which (``running`` until then), and nothing is dispatched after it;
- every dispatched group ends exactly once, as ``trained`` (with the version its step
  produced) or ``dropped`` with a reason (``stale``, ``infra_error``, ``deadline``,
  ``run_finished``, ``no_signal``), or is still in flight; the row is written before the request is
  published and ended by a conditional update, so no group is lost or ended twice;
- admission control bounds staleness (modes ``sync`` and ``async``): groups are
  dispatched only while ``dispatched <= min(steps, published_version + s + 1) *
  groups_per_step + dropped``, ``s`` = ``max_staleness`` (0 in ``sync``: every group is
  generated and trained under one version); a drop frees a slot for a replacement;
- ``april`` keeps ``ceil(overprovision * groups_per_step)`` groups in flight, and when a
  batch is full it tells rollout to suspend the rest (``abort``), which then resume
  under the next version; with ``max_staleness`` >= 2 the full batch's groups stop
  counting as in flight, so the next ones are generated while the learner trains;
  staleness is bounded where samples resume (rollout abandons stale groups, and the
  controller drops them as ``stale``) and again where they train;
- each sample of a group is its own trace: the controller starts one ``dispatch`` span
  per sample and sends its ``traceparent`` in the request;
- the data cursor is the group index: group ``n`` of a run always gets the same task
  (drawn from ``run.seed`` and ``n``), so a resumed controller, which reads what was
  dispatched, dropped and is still in flight back from the database, continues the
  very sequence an uninterrupted run would have dispatched.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from opentelemetry.context import Context
from sqlalchemy import select, update

from kiln.learner.config import LearnerConfig
from kiln.learner.ledger import NO_SIGNAL
from kiln.shared import contracts as c
from kiln.shared.db import Database, Run, StepRecord, TaskGroup, TrajectoryRecord
from kiln.shared.evaluation import EvalCollector
from kiln.shared.service import ServiceContext
from kiln.shared.tasks import TaskSuite
from kiln.shared.telemetry import traceparent

log = logging.getLogger("kiln.learner.controller")


@dataclass(frozen=True)
class RunOutcome:
    """How the run stands: ``running`` until the controller ends it, then once and for
    all ``finished`` or ``failed`` (``detail``: why), at ``version``, the newest
    version published when it ended (-1: none)."""

    status: Literal["running", "finished", "failed"] = "running"
    detail: str = ""
    version: int = -1

    @property
    def ended(self) -> bool:
        return self.status != "running"

    @property
    def ok(self) -> bool:
        """The run ended as finished (not failed, and not still running)."""
        return self.status == "finished"


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)  # SQLite drops the zone


class Controller:
    def __init__(self, ctx: ServiceContext, db: Database, suite: TaskSuite, evals: EvalCollector | None = None):
        self.ctx = ctx
        self.cfg: LearnerConfig = ctx.config  # type: ignore[assignment]
        self.db = db
        self.run_id = self.cfg.run.id
        self.suite = suite
        self.tasks = suite.split(self.cfg.tasks.split)
        self.set_aside_envs: dict[str, str] = {}
        """Environments that cannot be built -> why; their tasks are no longer dispatched."""
        self.published_version = -1
        self.dispatched = 0
        self.dropped = 0
        self.filtered = 0
        """Of ``dropped``, the ``no_signal`` ones."""
        self._dropped_since_step = 0
        """Drops since the trainer last took the count (``take_step_drops``)."""
        self.trained = 0
        self.inflight: dict[str, c.RolloutRequest] = {}
        self.training: set[str] = set()
        """April: the groups of the batch being trained (in flight until marked trained)."""
        self.evals = evals
        self.finished = asyncio.Event()
        self.closing = False
        """Set (under the lock) once the run ends: nothing is dispatched after it."""
        self.outcome = RunOutcome()
        self._lock = asyncio.Lock()
        self._recorded: dict[int, asyncio.Event] = {0: asyncio.Event()}
        self._recorded[0].set()

    # --- run lifecycle ---------------------------------------------------------

    async def start_run(self, resume_version: int | None = None) -> None:
        """Create the run, or with ``resume_version`` (the restored policy's version) take
        up an existing one where its database says it stands."""
        async with self.db.session() as s:
            run = await s.get(Run, self.run_id)
            if run is None:
                s.add(Run(id=self.run_id, name=self.cfg.run.name, config=self.cfg.model_dump(mode="json")))
            elif run.status != "running":
                raise RuntimeError(f"run {self.run_id} is already {run.status}")
            groups = (await s.execute(select(TaskGroup).where(TaskGroup.run_id == self.run_id))).scalars().all()
        if groups and resume_version is None:
            raise RuntimeError(
                f"run {self.run_id} already has {len(groups)} groups and no learner checkpoint to resume from;"
                " start a new run id"
            )
        if resume_version is not None:
            self._restore(groups, resume_version)
        kind = "resumed" if resume_version is not None else "started"
        await self.ctx.bus.publish(c.RUN_EVENTS, c.RunEvent(run_id=self.run_id, kind=kind))

    def _restore(self, groups: list[TaskGroup], version: int) -> None:
        self.dispatched = len(groups)
        self.dropped = sum(g.status == "dropped" for g in groups)
        self.filtered = sum(g.status == "dropped" and g.reason == NO_SIGNAL for g in groups)
        self.trained = sum(g.status == "trained" for g in groups)
        for g in groups:
            if g.status == "dispatched":
                self.inflight[g.group_id] = c.RolloutRequest(
                    run_id=self.run_id,
                    group_id=g.group_id,
                    task_id=g.task_id,
                    n_samples=g.n_samples,
                    dispatch_version=g.dispatch_version,
                    deadline=_utc(g.deadline).timestamp(),
                )
        for v in range(version + 1):
            self._recorded.setdefault(v, asyncio.Event()).set()
        log.info(
            "resuming run %s at version %d: %d groups dispatched, %d in flight, %d trained, %d dropped",
            self.run_id,
            version,
            self.dispatched,
            len(self.inflight),
            self.trained,
            self.dropped,
        )

    def task_for(self, index: int):
        return random.Random(f"{self.cfg.run.seed}:{index}").choice(self.tasks)

    def set_aside(self, task_id: str, reason: str) -> None:
        """The task's environment cannot be built: dispatch none of its tasks again this run
        (recorded once; a build is never retried in a loop). With nothing left to dispatch,
        ``refill`` does nothing and the next drop (this group's) ends the run as failed."""
        env = self.suite.get(task_id).environment
        if env is None or env in self.set_aside_envs:
            return
        self.set_aside_envs[env] = reason
        left = [t for t in self.tasks if t.environment != env]
        log.error(
            "environment %r cannot be built: its %d tasks are set aside for this run (%s)",
            env,
            len(self.tasks) - len(left),
            reason,
        )
        self.tasks = left

    async def finish_run(self, status: Literal["finished", "failed"] = "finished", detail: str = "") -> None:
        async with self._lock:
            # Under the lock, before the in-flight groups end: a refill waiting for the lock
            # (a drop's) must not dispatch a group after them that nothing would ever end,
            # and a second finish (a failure racing the last version) changes nothing.
            if self.closing:
                return
            self.closing = True
            self.outcome = RunOutcome(status, detail, self.published_version)
            for gid in list(self.inflight):
                await self._end(gid, "dropped", reason="run_finished", detail="the run ended before this group trained")
        async with self.db.session() as s:
            await s.execute(
                update(Run)
                .where(Run.id == self.run_id)
                .values(status=status, detail=detail, finished_at=datetime.now(UTC))
            )
        await self.ctx.bus.publish(
            c.RUN_EVENTS,
            c.RunEvent(run_id=self.run_id, kind="finished" if status == "finished" else "failed", detail=detail),
        )
        self.finished.set()

    # --- reacting to events ----------------------------------------------------

    async def on_published(self, msg: c.WeightsPublished) -> None:
        if msg.run_id != self.run_id or msg.version <= self.published_version:
            return
        self.published_version = msg.version
        log.info("version %d published", msg.version)
        last = msg.version >= self.cfg.algorithm.steps
        e = self.cfg.eval
        if self.evals is not None and (msg.version % e.every == 0 or last):
            await self.evals.start(self.run_id, f"{self.run_id}-eval-v{msg.version}", msg, e, self.cfg.tasks.suite)
        if last:
            # The trainer may still be recording the step that produced this version.
            await self._recorded.setdefault(msg.version, asyncio.Event()).wait()
            if self.evals is not None:
                # The run's result is its last version's evaluation: wait for it (and any
                # earlier one still running), bounded by the evaluation timeout.
                for eval_id in self.evals.outstanding():
                    try:
                        await self.evals.wait(eval_id, e.timeout_s)
                    except TimeoutError:
                        await self.evals.expire()
            await self.finish_run()
        else:
            await self.refill()

    async def step_finished(self, version: int, metrics: c.StepMetrics | None, *, resumed: bool = False) -> None:
        """The trainer has stamped and acked everything the step producing ``version``
        used: write the step's row (``metrics``; None: a resumed step without one),
        publish its metrics (not again for a ``resumed`` step), and only then let the last
        version end the run (``on_published`` waits for this)."""
        if metrics is not None:
            await self._record_step(metrics)
            if not resumed:
                await self.ctx.bus.publish(c.STEP_METRICS, metrics)
        self._recorded.setdefault(version, asyncio.Event()).set()

    # --- what the trainer asks --------------------------------------------------

    def group_size(self, group_id: str) -> int | None:
        req = self.inflight.get(group_id)
        return None if req is None else req.n_samples

    def staleness_limit(self) -> int:
        a = self.cfg.algorithm
        return 0 if a.mode == "sync" else a.max_staleness

    def last_published(self) -> int:
        return self.published_version

    def take_step_drops(self) -> int:
        """The groups dropped since the last call (the previous step's), and the next
        count starts now: taken and reset together, so whenever the trainer takes it no
        drop is counted twice or lost."""
        n, self._dropped_since_step = self._dropped_since_step, 0
        return n

    async def refill(self) -> None:
        a = self.cfg.algorithm
        async with self._lock:
            if self.closing or self.published_version < 0 or not self.tasks:
                return
            if a.mode == "april":
                target = math.ceil(a.overprovision * a.groups_per_step)
                total = a.steps * a.groups_per_step + target - a.groups_per_step
                while len(self.inflight) - len(self.training) < target and self.dispatched - self.dropped < total:
                    await self._dispatch()
                return
            horizon = min(a.steps, self.published_version + self.staleness_limit() + 1)
            allowed = horizon * a.groups_per_step + self.dropped
            while self.dispatched < allowed:
                await self._dispatch()

    async def batch_full(self, version: int, batch: list[str]) -> None:
        """The batch that makes ``version`` is full: suspend what rollout is generating.
        Where april overlaps (``AlgorithmSettings.april_overlaps``) the batch's groups stop
        counting against the groups kept in flight, so the next batch's groups are
        dispatched, and generated under the current version, while the learner trains."""
        a = self.cfg.algorithm
        if a.mode != "april":
            return
        if len(self.inflight) > a.groups_per_step:
            await self.ctx.bus.publish(
                c.ROLLOUT_CONTROL, c.RolloutControl(run_id=self.run_id, kind="abort", version=version)
            )
        if a.april_overlaps and version < a.steps:  # after the last batch nothing more trains
            self.training = set(batch)
            await self.refill()

    async def _dispatch(self) -> None:
        a = self.cfg.algorithm
        task = self.task_for(self.dispatched)
        gid = f"{self.run_id}-g{self.dispatched:06d}"
        deadline = time.time() + a.group_deadline_s
        traces = []
        for i in range(a.samples_per_group):
            span = self.ctx.tracer.start_span(
                "controller.dispatch",
                context=Context(),  # a new root: each trajectory is its own trace
                attributes={"group_id": gid, "sample": i, "task_id": task.id, "policy.version": self.published_version},
            )
            traces.append(traceparent(span))
            span.end()
        req = c.RolloutRequest(
            run_id=self.run_id,
            group_id=gid,
            task_id=task.id,
            n_samples=a.samples_per_group,
            dispatch_version=self.published_version,
            deadline=deadline,
            sample_traces=traces,
        )
        async with self.db.session() as s:
            s.add(
                TaskGroup(
                    group_id=gid,
                    run_id=self.run_id,
                    task_id=task.id,
                    n_samples=a.samples_per_group,
                    dispatch_version=self.published_version,
                    deadline=datetime.fromtimestamp(deadline, UTC),
                )
            )
        self.dispatched += 1
        self.inflight[gid] = req
        self.ctx.metrics.dispatched.add(1)
        self.ctx.metrics.in_flight.set(len(self.inflight))
        await self.ctx.bus.publish(c.ROLLOUT_WORK, req, msg_id=gid)

    async def drop(self, group_id: str, reason: str, detail: str = "") -> None:
        async with self._lock:
            await self._end(group_id, "dropped", reason=reason, detail=detail)
        limit, failed = self.cfg.learner.max_dropped_groups, self.dropped - self.filtered
        if failed > limit:
            await self.finish_run(
                "failed", f"{failed} groups dropped (limit {limit}); the last: {reason}: {detail}"[:2000]
            )
            return
        if not self.tasks:  # every environment set aside: nothing can replace this group
            why = "; ".join(f"{e}: {r}" for e, r in self.set_aside_envs.items())
            await self.finish_run("failed", f"no task left to dispatch: environments cannot be built ({why})")
            return
        await self.refill()

    async def mark_trained(
        self, group_ids: list[str], trajectory_ids: list[str], version: int, *, resumed: bool = False
    ) -> None:
        """``resumed``: re-stamping a restored checkpoint's groups, some already ended."""
        async with self._lock:
            for gid in group_ids:
                if resumed and gid not in self.inflight:
                    continue
                await self._end(gid, "trained", trained_version=version)
        async with self.db.session() as s:
            await s.execute(
                update(TrajectoryRecord)
                .where(TrajectoryRecord.trajectory_id.in_(trajectory_ids))
                .values(trained_version=version)
            )

    async def _record_step(self, m: c.StepMetrics) -> None:
        """The step's metrics as its ``steps`` row; merged, so a resumed learner that
        redoes a step overwrites the row rather than failing on it."""
        async with self.db.session() as s:
            await s.merge(
                StepRecord(
                    run_id=m.run_id,
                    step=m.step,
                    version=m.version,
                    trajectories=m.trajectories,
                    mean_reward=m.mean_reward,
                    pass_rate=m.pass_rate,
                    loss=m.loss,
                    mean_staleness=m.mean_staleness,
                    max_staleness=m.max_staleness,
                    step_seconds=m.step_seconds,
                    wait_seconds=m.wait_seconds,
                    elapsed_seconds=m.elapsed_seconds,
                    metrics=m.model_dump(mode="json"),
                )
            )

    async def _end(
        self, group_id: str, status: str, *, reason: str | None = None, detail: str = "", trained_version=None
    ) -> None:
        async with self.db.session() as s:
            res = await s.execute(
                update(TaskGroup)
                .where(TaskGroup.group_id == group_id, TaskGroup.status == "dispatched")
                .values(
                    status=status,
                    reason=reason,
                    detail=detail,
                    trained_version=trained_version,
                    ended_at=datetime.now(UTC),
                )
            )
        if res.rowcount != 1:
            raise RuntimeError(f"group {group_id} was already ended; refusing to end it twice")
        self.inflight.pop(group_id, None)
        self.training.discard(group_id)
        self.ctx.metrics.in_flight.set(len(self.inflight))
        if status == "dropped":
            self.ctx.metrics.dropped.add(1, {"reason": reason or ""})
            self.dropped += 1
            self.filtered += reason == NO_SIGNAL
            self._dropped_since_step += 1
            log.warning("dropped group %s: %s %s", group_id, reason, detail)
            await self.ctx.bus.publish(
                c.GROUP_DROPPED,
                c.GroupDropped(run_id=self.run_id, group_id=group_id, reason=reason, detail=detail),
                msg_id=f"drop-{group_id}",
            )
        else:
            self.trained += 1

    async def expired(self, exclude: set[str]) -> list[str]:
        """In-flight groups past their deadline (``exclude``: complete ones waiting to train)."""
        now = time.time()
        return [g for g, r in self.inflight.items() if r.deadline < now and g not in exclude]
