"""An eval worker (``rollout.role = eval``): evaluation episodes under exactly the
version each request names, with the same agent loop, tools and sandboxes as training
(each episode through the same sample lifecycle, ``lifecycle.SampleLifecycle``).

Invariants:
- every episode of a request runs under the request's version: a worker switches
  versions only when no episode is running (requests for the version it serves go
  first), through the same feed as a training worker (always a files feed: an eval
  worker never joins a broadcast group), which serves a version only after its files
  matched the manifest's sha256;
- seeds depend on the evaluation's seed, the task, the mode and the sample only, never
  on the version, so versions are compared on the same random numbers;
- a request is acked after all its trajectories are published (ids
  ``<eval_id>-<task>-<mode>-s<i>``, deduped by the stream), so a worker that dies
  mid-request loses nothing: it is redelivered and re-run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from opentelemetry import trace
from opentelemetry.context import Context

from kiln.rollout.lifecycle import EpisodeSpec
from kiln.rollout.worker import RolloutWorker, stable_seed
from kiln.shared import contracts as c
from kiln.shared.bus import Delivery, Reject, Retry
from kiln.shared.weights.transport.base import VersionUnavailable

log = logging.getLogger("kiln.rollout.eval")


class EvalWorker(RolloutWorker):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._users = 0
        self._gate = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def serving(self, weights: c.WeightsPublished):
        async with self._gate:
            await self._gate.wait_for(lambda: self.engine.version == weights.version or self._users == 0)
            if self.engine.version != weights.version:
                try:
                    await self.feed.switch_to(weights)
                except VersionUnavailable as e:
                    raise Retry(f"version {weights.version} cannot be loaded: {e}", 5.0) from None
                self.ctx.health_detail.update(version=weights.version)
                log.info("evaluating under version %d", weights.version)
            self._users += 1
        try:
            yield
        finally:
            async with self._gate:
                self._users -= 1
                self._gate.notify_all()

    async def on_eval(self, req: c.EvalRequest, delivery: Delivery) -> None:
        try:
            task = self.suite.get(req.task_id)
        except KeyError as e:
            raise Reject(str(e)) from None
        rr = c.RolloutRequest(
            run_id=req.run_id,
            group_id=f"{req.eval_id}-{req.task_id}-{req.mode}",
            task_id=req.task_id,
            n_samples=req.n_samples,
            dispatch_version=req.weights.version,
            deadline=req.deadline,
        )
        async with self.engine_alive(), self.serving(req.weights):
            await asyncio.gather(*(self._episode(req, rr, task, i) for i in range(req.n_samples)))

    async def _episode(self, req: c.EvalRequest, rr: c.RolloutRequest, task, index: int) -> None:
        with self.ctx.tracer.start_as_current_span(
            "eval.trajectory",
            context=Context(),
            kind=trace.SpanKind.CONSUMER,
            attributes={
                "eval_id": req.eval_id,
                "task_id": req.task_id,
                "mode": req.mode,
                "sample": index,
                "policy.version": req.weights.version,
            },
        ):
            spec = EpisodeSpec(
                request=rr,
                sample_index=index,
                task=task,
                worker_id=self.ctx.instance,
                seed=stable_seed("eval", req.seed, req.task_id, req.mode, index),
                temperature=req.temperature,
                tools=tuple(self.cfg.tasks.tools),
            )
            traj = await self.play(spec, abortable=False)  # kiln's own loop: an eval worker serves no endpoint
            assert isinstance(traj, c.Trajectory), "an evaluation is never suspended nor stale"
            traj = traj.model_copy(update={"purpose": "eval", "eval_id": req.eval_id})
            ack = await self.ctx.bus.publish(c.TRAJECTORY_FINISHED, traj, msg_id=traj.trajectory_id)
            if ack.duplicate and traj.sandbox:
                await self._destroy([traj.sandbox])
            self.ctx.metrics.trajectories.add(1, {"status": traj.status.value})
