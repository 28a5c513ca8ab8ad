"""learner entrypoint: ``python -m kiln.learner.main``.

Starts the run (its database row), trains the tokenizer and initial policy and hands
version 0 to the weights service (or, when the run has a learner checkpoint, restores
the whole state and takes the run up where it stopped; on a multi-rank world this is
rank 0, and ranks 1.. run ``kiln.learner.follower``: under torchrun as processes of their own,
with ``learner.launcher.kind = "ray"`` as Ray actors this process starts), then reacts: every published version lets the
controller dispatch more groups, every scored trajectory goes to the trainer.

Invariants: the controller alone ends the run (``Controller.finish_run``; the trainer
reports to it through ``TrainerLedger``), and this entrypoint only waits for that, or
for a stop, and reads ``controller.outcome`` (a ``RunOutcome``): a failed run fails the
service. Nothing in the learner imports this module (no import cycle).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import torch.distributed as dist
from nats.js.errors import NotFoundError

from kiln.learner.config import LearnerConfig
from kiln.learner.controller import Controller

# Ray pickles a function of an importable module by reference, one of ``__main__`` by
# value: the followers it starts are ``kiln.learner.follower.follower``, never this file's.
from kiln.learner.follower import follower, follower_main
from kiln.learner.policy import Policy
from kiln.learner.state import Checkpointer, checkpoint_root
from kiln.learner.trainer import Trainer
from kiln.learner.world import dims_of, join, start_ray_ranks
from kiln.shared import contracts as c
from kiln.shared.db import Database
from kiln.shared.evaluation import EvalCollector
from kiln.shared.service import ServiceContext, service_main, wait_or_stop
from kiln.shared.tasks import load_suite

log = logging.getLogger("kiln.learner")


async def serve(ctx: ServiceContext) -> None:
    cfg: LearnerConfig = ctx.config  # type: ignore[assignment]
    if not cfg.run.id:
        raise ValueError("run.id is empty: the learner drives one run (set KILN_RUN__ID or start with `kiln run`)")
    db = Database(cfg.database.url, cfg.database.echo)
    world = ray_ranks = watch_ranks = None
    try:
        suite = load_suite(cfg.tasks.suite)
        evals = None
        if cfg.eval.every > 0:
            evals = EvalCollector(ctx.bus, db, suite)
            await evals.watch()
        controller = Controller(ctx, db, suite, evals)
        checkpointer = Checkpointer(checkpoint_root(cfg), keep=cfg.learner.checkpoint.keep)
        meta = checkpointer.latest() if cfg.learner.checkpoint.resume else None
        if cfg.learner.launcher.kind == "ray" and dims_of(cfg).world > 1:
            ray_ranks = await asyncio.to_thread(start_ray_ranks, cfg, follower)
            watch_ranks = asyncio.create_task(_watch_ray_ranks(ctx, ray_ranks))
        world = await asyncio.to_thread(join, cfg)
        policy = await asyncio.to_thread(Policy, cfg, suite, world)
        if meta is not None:
            if world is not None:
                world.announce("load", meta)
            await asyncio.to_thread(checkpointer.load, policy.model, policy.optimizer, policy.scheduler, meta)
            log.info("restored the learner's state after step %d (version %d)", meta.step, meta.version)
        await controller.start_run(resume_version=meta.version if meta else None)
        log.info(
            "policy: %d parameters, vocabulary %d", policy.model.num_parameters(), policy.tokenizer.get_vocab_size()
        )
        trainer = Trainer(ctx, controller, policy, checkpointer)
        await ctx.bus.watch(c.weights_published_subject(cfg.run.id), c.WeightsPublished, controller.on_published)
        if meta is None:
            await trainer.publish_initial()
        else:
            await trainer.resume(meta)

        done = asyncio.Event()

        async def until_done() -> None:
            stop_wait = asyncio.create_task(ctx.stop.wait())
            fin_wait = asyncio.create_task(controller.finished.wait())
            await asyncio.wait({stop_wait, fin_wait}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            fin_wait.cancel()
            done.set()

        async def deadlines() -> None:
            while not await wait_or_stop(done, cfg.learner.deadline_check_s):
                await trainer.expire()
                if evals is not None:
                    await evals.expire()

        async def queue_depths() -> None:
            # The controller is the one process that sees the whole pipeline: it samples
            # every JetStream consumer's backlog for the dashboards.
            while True:
                for spec in c.CONSUMERS:
                    try:
                        info = await ctx.bus.js.consumer_info(spec.stream, spec.durable)
                    except NotFoundError:  # its stream or consumer is created by a service not up yet
                        continue
                    ctx.metrics.pending.set(info.num_pending, {"consumer": spec.durable})
                    ctx.metrics.ack_pending.set(info.num_ack_pending, {"consumer": spec.durable})
                if await wait_or_stop(done, cfg.learner.queue_sample_s):
                    return

        watcher = asyncio.create_task(until_done())
        expiry = asyncio.create_task(deadlines())
        depths = asyncio.create_task(queue_depths())
        abandoned = asyncio.create_task(
            ctx.bus.consume(c.ABANDONED, c.GroupAbandoned, lambda m, _d: trainer.on_abandoned(m), stop=done)
        )
        await ctx.bus.consume(c.LEARNER, c.ScoredTrajectory, trainer.on_scored, stop=done, ready=ctx.ready)
        await watcher
        await expiry
        await depths
        await abandoned
        await trainer.release(run_finished=controller.finished.is_set())
        if not controller.finished.is_set():
            log.info(
                "stopped before the run finished (version %d of %d)", controller.published_version, cfg.algorithm.steps
            )
        elif not controller.outcome.ok:
            raise RuntimeError(f"run {cfg.run.id} failed: {controller.outcome.detail}")
    finally:
        if world is not None:
            try:
                world.announce("stop")
            except RuntimeError as e:  # the followers already went (a SIGTERM reaches every rank)
                log.info("follower ranks gone before the stop command: %s", e)
            dist.destroy_process_group()
        if ray_ranks is not None:
            watch_ranks.cancel()
            # Without a formed world nothing told the ranks to stop: remove them at once.
            await asyncio.to_thread(ray_ranks.close, 60.0 if world is not None else 0.0)
        await db.close()


async def _watch_ray_ranks(ctx: ServiceContext, ranks) -> None:
    """A Ray rank that ends before rank 0 said stop (its node died, an error) leaves the
    world broken: fail the service, so its supervisor restarts it from the checkpoint."""
    done, _ = await asyncio.wait([asyncio.wrap_future(f) for f in ranks.futures()], return_when=asyncio.FIRST_COMPLETED)
    for fut in done:
        ctx.fail(f"a Ray rank of the learner ended early: {fut.exception() or 'returned'}")


def main() -> None:
    if int(os.environ.get("RANK", "0")) > 0:
        follower_main(sys.argv[1:])
        return
    service_main("learner", LearnerConfig, serve)


if __name__ == "__main__":
    main()
