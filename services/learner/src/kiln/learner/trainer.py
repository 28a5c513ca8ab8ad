"""The learner loop: group scored trajectories, train when a batch is full, publish.

The trainer holds the controller only as a ``TrainerLedger`` (``ledger.py``): it asks
it which groups are in flight and how stale a group may be, and tells it drops,
set-aside environments and finished steps. It never ends the run: the controller
decides that from what it is told.

Invariants:
- a scored trajectory's message stays unacked (held, heartbeated) until the step that
  trained it has handed its checkpoint to the weights stream, or until its group was
  dropped; a learner that dies before that gets every such message redelivered;
- a group enters a batch only when all its samples are scored; ``infra_error``
  trajectories are excluded from its advantage statistics, and a group with no valid
  sample, or whose oldest generated token is more than ``max_staleness`` versions
  behind the version it would train (``sync``: 0), is dropped with that reason instead
  of trained, so no stale group ever reaches a step; with
  ``algorithm.uniform_group_retries`` up to that many complete groups per step whose
  valid samples all scored alike (zero advantage) are dropped as ``no_signal`` and
  replaced, and any beyond train as usual;
- in ``april`` mode a full batch first tells rollout to suspend what it is generating;
- the version a step produces is ``step + 1``; the trajectories it trained are stamped
  with it in the database (``trained_version``);
- the learner's whole state after a step is committed to a checkpoint (``state.py``)
  before that step's version is handed over and its messages acked, so a learner that
  is killed and resumed trains every group in exactly one step;
- a batch is ordered by group id and sample index, not by arrival, so the same groups
  give the same step however their messages were (re)delivered.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from opentelemetry import trace

from kiln.learner.config import LearnerConfig
from kiln.learner.grpo import group_advantages
from kiln.learner.ledger import NO_SIGNAL, TrainerLedger
from kiln.learner.policy import Policy
from kiln.learner.state import Checkpointer, Meta
from kiln.shared import contracts as c
from kiln.shared.bus import Delivery
from kiln.shared.service import ServiceContext
from kiln.shared.telemetry import extract_context
from kiln.shared.weights.manifest import file_infos

log = logging.getLogger("kiln.learner.trainer")


class Trainer:
    def __init__(
        self, ctx: ServiceContext, controller: TrainerLedger, policy: Policy, checkpointer: Checkpointer | None = None
    ):
        self.ctx = ctx
        self.cfg: LearnerConfig = ctx.config  # type: ignore[assignment]
        self.controller = controller
        self.policy = policy
        self.checkpointer = checkpointer
        self.step = 0
        self.pending: dict[str, dict[str, tuple[c.ScoredTrajectory, Delivery]]] = {}
        self.ready: list[str] = []
        self.filtered_this_step = 0
        """Groups dropped as ``no_signal`` since the last step (``algorithm.uniform_group_retries``)."""
        self.started = time.monotonic()
        self.idle_since = time.monotonic()
        self._lock = asyncio.Lock()  # scored messages, deadline expiry and steps never interleave
        run_dir = Path(self.cfg.run.dir) if self.cfg.run.dir else Path.cwd()
        self.staging = Path(self.cfg.learner.staging_dir) if self.cfg.learner.staging_dir else run_dir / "staging"

    async def publish_initial(self) -> None:
        await self._hand_over(0, parent=None)

    async def resume(self, meta: Meta) -> None:
        """Take up the run from a restored checkpoint: hand its version over again (the
        weights service stores a version once), stamp the groups its step trained and
        write its ``steps`` row (each done at most once, whatever the crash left undone)."""
        self.step = meta.step
        if meta.version == 0:
            await self.publish_initial()
            return
        await self._hand_over(meta.version, parent=meta.version - 1)
        await self.controller.mark_trained(meta.trained_groups, meta.trained_trajectories, meta.version, resumed=True)
        # Its ``steps`` row, in case the learner died before writing it (merged: written once).
        metrics = c.StepMetrics.model_validate(meta.metrics) if meta.metrics else None
        await self.controller.step_finished(meta.version, metrics, resumed=True)

    async def _hand_over(self, version: int, parent: int | None, committed=None) -> None:
        """Stage ``version`` and publish it; ``committed`` (blocking) runs between the two."""
        run_staging = self.staging / self.cfg.run.id
        folder = run_staging / f"v{version:06d}"
        shutil.rmtree(folder, ignore_errors=True)
        # Staged versions the weights service has already published are its now.
        if run_staging.is_dir():
            for old in run_staging.iterdir():
                if old.name[1:].isdigit() and int(old.name[1:]) < self.controller.last_published():
                    shutil.rmtree(old, ignore_errors=True)
        await asyncio.to_thread(self.policy.stage, folder)
        # Hashed here, where the bytes were made: the weights service does not hash again.
        files = await asyncio.to_thread(file_infos, folder)
        if committed is not None:
            await asyncio.to_thread(committed)
        await self.ctx.bus.publish(
            c.WEIGHTS_CHECKPOINT,
            c.PolicyCheckpoint(
                run_id=self.cfg.run.id,
                version=version,
                step=self.step,
                parent_version=parent,
                path=str(folder),
                files=files,
            ),
            msg_id=f"{self.cfg.run.id}-ckpt-v{version}",
        )

    def _checkpoint(self, meta: Meta) -> None:
        p = self.policy
        if p.world is not None:  # every rank writes its shards; collectives run in lockstep
            p.world.announce("checkpoint", meta)
            self.checkpointer.save(p.model, p.optimizer, p.scheduler, meta, asynchronous=False)
        else:
            self.checkpointer.save(
                p.model, p.optimizer, p.scheduler, meta, asynchronous=self.cfg.learner.checkpoint.asynchronous
            )

    async def on_scored(self, scored: c.ScoredTrajectory, delivery: Delivery) -> None:
        async with self._lock:
            await self._add(scored, delivery)

    async def _add(self, scored: c.ScoredTrajectory, delivery: Delivery) -> None:
        t = scored.trajectory
        size = self.controller.group_size(t.group_id) if t.run_id == self.cfg.run.id else None
        if size is None:
            # Another run's, or a late sample of a group that already ended (dropped).
            log.info("ignoring %s: its group is not in flight", t.trajectory_id)
            return
        delivery.hold()
        group = self.pending.setdefault(t.group_id, {})
        old = group.get(t.trajectory_id)
        group[t.trajectory_id] = (scored, delivery)
        if old is not None:  # a redelivery of a message we hold: keep the newest handle
            await old[1].ack()
        if len(group) < size or t.group_id in self.ready:
            return
        await self._group_complete(t.group_id)
        # Over-provisioned groups still finish after the last step: they wait, and the
        # run's end drops them (``run_finished``), rather than train a version past ``steps``.
        if len(self.ready) >= self.cfg.algorithm.groups_per_step and self.step < self.cfg.algorithm.steps:
            await self.controller.batch_full(self.step + 1, self.ready[: self.cfg.algorithm.groups_per_step])
            await self._train()

    async def on_abandoned(self, msg: c.GroupAbandoned) -> None:
        """Rollout gave up on a group (stale partials): drop it, releasing what we hold."""
        async with self._lock:
            if (
                msg.run_id == self.cfg.run.id
                and self.controller.group_size(msg.group_id) is not None
                and msg.group_id not in self.ready
            ):
                await self._drop(msg.group_id, msg.reason, msg.detail)

    async def _group_complete(self, gid: str) -> None:
        samples = [s for s, _ in self.pending[gid].values()]
        valid = [s for s in samples if not s.infra_error]
        if not valid:
            broken = next((s for s in samples if s.trajectory.infra_code == c.ENVIRONMENT_ERROR), None)
            if broken is not None:  # before the drop: the group that replaces this one must not need it
                self.controller.set_aside(broken.trajectory.task_id, broken.infra_error or "")
            # With every environment set aside, the controller ends the run on this drop.
            await self._drop(gid, "infra_error", f"all {len(samples)} samples failed: {samples[0].infra_error}")
            return
        if await self._drop_if_stale(gid):
            return
        rewards = {s.reward for s in valid}
        a = self.cfg.algorithm
        budget = a.uniform_group_retries if self.step < a.steps else 0  # after the last step nothing trains
        if len(valid) > 1 and len(rewards) == 1 and self.filtered_this_step < budget:
            # Every advantage of this group is 0: it would cost a slot of the batch and teach nothing.
            self.filtered_this_step += 1
            await self._drop(gid, NO_SIGNAL, f"all {len(valid)} samples scored {rewards.pop()}")
            return
        self.ready.append(gid)

    def _export(self, m: c.StepMetrics, staleness: list[int]) -> None:
        inst = self.ctx.metrics
        inst.version.set(m.version)
        inst.trained.add(m.trajectories)
        for s in staleness:
            inst.staleness.record(s)
        inst.step_seconds.add(m.step_seconds)
        inst.wait_seconds.add(m.wait_seconds)
        inst.idle.set(m.wait_seconds / max(1e-9, m.wait_seconds + m.step_seconds))
        inst.reward.set(m.mean_reward)
        inst.pass_rate.set(m.pass_rate)
        inst.generated.add(m.generated_tokens)
        inst.off_policy.add(m.off_policy_tokens)

    async def _drop_if_stale(self, gid: str) -> bool:
        limit = self.controller.staleness_limit()
        versions = [
            v for s, _ in self.pending[gid].values() if not s.infra_error for v in s.trajectory.generated_versions()
        ]
        # Counted against the version this learner trains now, so queue time counts too.
        lag = self.step - min(versions) if versions else 0
        if lag > limit:
            await self._drop(gid, "stale", f"oldest token is {lag} versions old (max {limit})")
            return True
        return False

    async def _drop(self, gid: str, reason: str, detail: str) -> None:
        held = self.pending.pop(gid, {})
        await self.controller.drop(gid, reason, detail)
        for _, d in held.values():
            await d.ack()

    async def expire(self) -> None:
        async with self._lock:
            for gid in await self.controller.expired(set(self.ready)):
                await self._drop(gid, "deadline", "not fully scored before its deadline")

    async def _train(self) -> None:
        a = self.cfg.algorithm
        groups, self.ready = self.ready[: a.groups_per_step], self.ready[a.groups_per_step :]
        waited = time.monotonic() - self.idle_since
        batch: list[tuple[c.Trajectory, float]] = []
        used: list[tuple[c.ScoredTrajectory, Delivery]] = []
        rewards, passes, infra = [], [], 0
        groups = sorted(groups)
        for gid in groups:
            entries = sorted(self.pending.pop(gid).values(), key=lambda e: e[0].trajectory.sample_index)
            used += entries
            valid = [s for s, _ in entries if not s.infra_error]
            infra += len(entries) - len(valid)
            for s, adv in zip(
                valid, group_advantages([s.reward for s in valid], a.std_normalize, negative_weight=a.negative_weight)
            ):
                batch.append((s.trajectory, adv))
                rewards.append(s.reward)
                passes.append(s.passed)
        version = self.step + 1
        staleness = [version - 1 - min(t.generated_versions() or [version - 1]) for t, _ in batch]
        generated = [v for t, _ in batch for v in t.generated_versions()]
        with self.ctx.tracer.start_as_current_span(
            "learner.train_step",
            links=[trace.Link(trace.get_current_span(extract_context(d.headers)).get_span_context()) for _, d in used],
            attributes={"step": self.step, "policy.version": version, "trajectories": len(batch)},
        ):
            stats = await asyncio.to_thread(self.policy.train_step, batch, self.step)
            self.step += 1
            dropped = self.controller.take_step_drops()
            metrics = c.StepMetrics(
                run_id=self.cfg.run.id,
                step=self.step - 1,
                version=version,
                groups=len(groups),
                trajectories=len(used),
                mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
                pass_rate=sum(passes) / len(passes) if passes else 0.0,
                loss=stats.loss,
                infra_errors=infra,
                dropped_groups=dropped,
                mean_staleness=sum(staleness) / len(staleness) if staleness else 0.0,
                max_staleness=max(staleness, default=0),
                step_seconds=stats.seconds,
                wait_seconds=waited,
                tokens=stats.tokens,
                elapsed_seconds=time.monotonic() - self.started,
                generated_tokens=len(generated),
                off_policy_tokens=sum(v < version - 1 for v in generated),
                **{k: getattr(stats, k) for k in ("ratio_mean", "clip_frac", "kl", "aux_loss", "grad_norm", "lr")},
            )
            committed = None
            if self.checkpointer is not None:
                # The step's metrics ride in its checkpoint: a learner killed after the
                # commit but before the ``steps`` row is written writes it on resume.
                meta = Meta(
                    step=self.step,
                    version=version,
                    trained_groups=groups,
                    trained_trajectories=[s.trajectory.trajectory_id for s, _ in used],
                    metrics=metrics.model_dump(mode="json"),
                )
                await asyncio.to_thread(self._checkpoint, meta)
                committed = self.checkpointer.wait  # the DCP files are written while the version is staged
            await self._hand_over(version, parent=version - 1, committed=committed)
        now_ns = time.time_ns()
        for _, d in used:  # the step, as seen from each trajectory's own trace
            self.ctx.tracer.start_span(
                "learner.trained",
                context=extract_context(d.headers),
                attributes={"step": self.step - 1, "policy.version": version},
                start_time=now_ns,
            ).end(end_time=now_ns)
        await self.controller.mark_trained(groups, [s.trajectory.trajectory_id for s, _ in used], version)
        for _, d in used:
            await d.ack()
        self._export(metrics, staleness)
        await self.controller.step_finished(version, metrics)
        log.info(
            "step %d -> version %d: %d trajectories, reward %.3f, pass %.2f, loss %.4f (%.2fs, waited %.2fs)",
            metrics.step,
            version,
            metrics.trajectories,
            metrics.mean_reward,
            metrics.pass_rate,
            stats.loss,
            stats.seconds,
            waited,
        )
        self.idle_since = time.monotonic()
        self.filtered_this_step = 0
        for gid in list(self.ready):  # complete groups left for the next step have aged by one version
            if await self._drop_if_stale(gid):
                self.ready.remove(gid)

    async def release(self, run_finished: bool) -> None:
        """Settle every message still held: acked when the run finished (their groups were
        ended as ``run_finished``), handed back otherwise so a successor gets them."""
        for held in self.pending.values():
            for _, d in held.values():
                await (d.ack() if run_finished else d.nak())
        self.pending.clear()
