"""reward entrypoint: ``python -m kiln.reward.main``.

Pulls finished trajectories from the shared ``reward-workers`` consumer (any number of
replicas), scores each by running its task's tests in a clean room (a fresh sandbox with
the trajectory's diff, ``cleanroom.py``), records the score
and publishes a ``ScoredTrajectory`` for the learner.
"""

from __future__ import annotations

from kiln.reward.config import RewardConfig
from kiln.reward.scorer import Scorer
from kiln.shared import contracts as c
from kiln.shared.db import Database
from kiln.shared.service import ServiceContext, service_main
from kiln.shared.tasks import load_suite


async def serve(ctx: ServiceContext) -> None:
    cfg: RewardConfig = ctx.config  # type: ignore[assignment]
    db = Database(cfg.database.url, cfg.database.echo)
    scorer = None
    try:
        scorer = Scorer(ctx, db, load_suite(cfg.tasks.suite))
        await scorer.start()
        await ctx.bus.consume(
            c.REWARD_WORKERS,
            c.Trajectory,
            scorer.on_trajectory,
            stop=ctx.stop,
            concurrency=cfg.reward.concurrency,
            ready=ctx.ready,
        )
    finally:
        if scorer is not None:
            await scorer.room.close()
        await db.close()


def main() -> None:
    service_main("reward", RewardConfig, serve)


if __name__ == "__main__":
    main()
