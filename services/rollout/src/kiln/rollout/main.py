"""rollout entrypoint: ``python -m kiln.rollout.main``.

Watches ``kiln.weights.published.<run_id>`` (starting from the latest version) and
pulls ``RolloutRequest``s from the shared ``rollout-workers`` consumer, so any number
of replicas share the work.
"""

from __future__ import annotations

import logging

from kiln.shared import contracts as c
from kiln.shared.service import ServiceContext, service_main
from kiln.shared.tasks import load_suite

from kiln.rollout.config import RolloutConfig
from kiln.rollout.engine import TorchEngine
from kiln.rollout.worker import RolloutWorker

log = logging.getLogger("kiln.rollout")


async def serve(ctx: ServiceContext) -> None:
    cfg: RolloutConfig = ctx.config  # type: ignore[assignment]
    if not cfg.run.id:
        raise ValueError("run.id is empty: rollout serves one run (set KILN_RUN__ID or start with `kiln run`)")
    worker = RolloutWorker(ctx, TorchEngine(cfg.rollout.torch_threads), load_suite(cfg.tasks.suite))
    await ctx.bus.watch(c.weights_published_subject(cfg.run.id), c.WeightsPublished, worker.on_weights)
    await ctx.bus.consume(
        c.ROLLOUT_WORKERS, c.RolloutRequest, worker.on_request, stop=ctx.stop, concurrency=cfg.rollout.concurrent_groups, ready=ctx.ready
    )


def main() -> None:
    service_main("rollout", RolloutConfig, serve)


if __name__ == "__main__":
    main()
