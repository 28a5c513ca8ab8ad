"""The controller: the one place that decides what work exists.

It dispatches groups, drops the ones that can no longer train, and ends the run.

Invariants:
- every dispatched group ends exactly once, as ``trained`` (with the version its step
  produced) or ``dropped`` with a reason (``stale``, ``infra_error``, ``deadline``,
  ``run_finished``), or is still in flight; the row is written before the request is
  published and ended by a conditional update, so no group is lost or ended twice;
- admission control bounds staleness: groups are dispatched only while
  ``dispatched <= min(steps, published_version + max_staleness + 1) * groups_per_step
  + dropped``; with ``max_staleness = 0`` every group is generated and trained under
  the same version (a synchronous loop); a drop frees a slot for a replacement;
- each sample of a group is its own trace: the controller starts one ``dispatch`` span
  per sample and sends its ``traceparent`` in the request.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from datetime import datetime, timezone

from opentelemetry.context import Context
from sqlalchemy import func, select, update

from kiln.shared import contracts as c
from kiln.shared.db import Database, Run, TaskGroup, TrajectoryRecord
from kiln.shared.service import ServiceContext
from kiln.shared.tasks import TaskSuite
from kiln.shared.telemetry import traceparent

from kiln.learner.config import LearnerConfig

log = logging.getLogger("kiln.learner.controller")


class Controller:
    def __init__(self, ctx: ServiceContext, db: Database, suite: TaskSuite):
        self.ctx = ctx
        self.cfg: LearnerConfig = ctx.config  # type: ignore[assignment]
        self.db = db
        self.run_id = self.cfg.run.id
        self.tasks = suite.split(self.cfg.tasks.split)
        self.rng = random.Random(self.cfg.run.seed)
        self.published_version = -1
        self.dispatched = 0
        self.dropped = 0
        self.dropped_since_step = 0
        self.trained = 0
        self.inflight: dict[str, c.RolloutRequest] = {}
        self.finished = asyncio.Event()
        self.outcome: tuple[str, str] = ("running", "")
        self._lock = asyncio.Lock()
        self._recorded: dict[int, asyncio.Event] = {0: asyncio.Event()}
        self._recorded[0].set()

    # --- run lifecycle ---------------------------------------------------------

    async def start_run(self) -> None:
        async with self.db.session() as s:
            run = await s.get(Run, self.run_id)
            if run is None:
                s.add(Run(id=self.run_id, name=self.cfg.run.name, config=self.cfg.model_dump(mode="json")))
            elif run.status != "running":
                raise RuntimeError(f"run {self.run_id} is already {run.status}")
            existing = await s.scalar(select(func.count()).select_from(TaskGroup).where(TaskGroup.run_id == self.run_id))
        if existing:
            raise RuntimeError(
                f"run {self.run_id} already has {existing} groups: resuming a run is not supported yet; start a new run id"
            )
        await self.ctx.bus.publish(c.RUN_EVENTS, c.RunEvent(run_id=self.run_id, kind="started"))

    async def finish_run(self, status: str = "finished", detail: str = "") -> None:
        if self.finished.is_set():
            return
        self.outcome = (status, detail)
        async with self._lock:
            for gid in list(self.inflight):
                await self._end(gid, "dropped", reason="run_finished", detail="the run ended before this group trained")
        async with self.db.session() as s:
            await s.execute(
                update(Run)
                .where(Run.id == self.run_id)
                .values(status=status, detail=detail, finished_at=datetime.now(timezone.utc))
            )
        await self.ctx.bus.publish(
            c.RUN_EVENTS, c.RunEvent(run_id=self.run_id, kind="finished" if status == "finished" else "failed", detail=detail)
        )
        self.finished.set()

    # --- reacting to events ----------------------------------------------------

    async def on_published(self, msg: c.WeightsPublished) -> None:
        if msg.run_id != self.run_id or msg.version <= self.published_version:
            return
        self.published_version = msg.version
        log.info("version %d published", msg.version)
        if msg.version >= self.cfg.algorithm.steps:
            # The trainer may still be recording the step that produced this version.
            await self._recorded.setdefault(msg.version, asyncio.Event()).wait()
            await self.finish_run()
        else:
            await self.refill()

    def step_recorded(self, version: int) -> None:
        """The trainer has stamped and acked everything the step producing ``version`` used."""
        self._recorded.setdefault(version, asyncio.Event()).set()

    async def refill(self) -> None:
        a = self.cfg.algorithm
        async with self._lock:
            if self.finished.is_set() or self.published_version < 0:
                return
            horizon = min(a.steps, self.published_version + a.max_staleness + 1)
            allowed = horizon * a.groups_per_step + self.dropped
            while self.dispatched < allowed:
                await self._dispatch()

    async def _dispatch(self) -> None:
        a = self.cfg.algorithm
        task = self.rng.choice(self.tasks)
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
                    deadline=datetime.fromtimestamp(deadline, timezone.utc),
                )
            )
        self.dispatched += 1
        self.inflight[gid] = req
        await self.ctx.bus.publish(c.ROLLOUT_WORK, req, msg_id=gid)

    def is_inflight(self, group_id: str) -> bool:
        return group_id in self.inflight

    async def drop(self, group_id: str, reason: str, detail: str = "") -> None:
        async with self._lock:
            await self._end(group_id, "dropped", reason=reason, detail=detail)
        limit = self.cfg.learner.max_dropped_groups
        if self.dropped > limit:
            await self.finish_run(
                "failed", f"{self.dropped} groups dropped (limit {limit}); the last: {reason}: {detail}"[:2000]
            )
            return
        await self.refill()

    async def mark_trained(self, group_ids: list[str], trajectory_ids: list[str], version: int) -> None:
        async with self._lock:
            for gid in group_ids:
                await self._end(gid, "trained", trained_version=version)
            self.dropped_since_step = 0
        async with self.db.session() as s:
            await s.execute(
                update(TrajectoryRecord)
                .where(TrajectoryRecord.trajectory_id.in_(trajectory_ids))
                .values(trained_version=version)
            )

    async def _end(self, group_id: str, status: str, *, reason: str | None = None, detail: str = "", trained_version=None) -> None:
        async with self.db.session() as s:
            res = await s.execute(
                update(TaskGroup)
                .where(TaskGroup.group_id == group_id, TaskGroup.status == "dispatched")
                .values(
                    status=status,
                    reason=reason,
                    detail=detail,
                    trained_version=trained_version,
                    ended_at=datetime.now(timezone.utc),
                )
            )
        if res.rowcount != 1:
            raise RuntimeError(f"group {group_id} was already ended; refusing to end it twice")
        self.inflight.pop(group_id, None)
        if status == "dropped":
            self.dropped += 1
            self.dropped_since_step += 1
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
