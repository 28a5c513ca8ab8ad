"""Ranks 1..N-1 of a multi-rank learner: no bus, no database; rank 0 drives them.

Under torchrun these are processes of their own (``kiln.learner.main`` hands them here
by ``RANK``); with ``learner.launcher = "ray"`` rank 0 starts ``follower`` as Ray
actors (``kiln.learner.world.start_ray_ranks``, which is given the function rather than
importing it, so the learner's modules import one another without a cycle).
"""

from __future__ import annotations

import argparse
import logging
import os

import torch.distributed as dist

from kiln.learner.config import LearnerConfig
from kiln.learner.policy import Policy
from kiln.learner.state import Checkpointer, checkpoint_root
from kiln.learner.world import follow, join
from kiln.shared.config import load_config
from kiln.shared.tasks import load_suite


def follower_main(argv: list[str]) -> None:
    """Ranks 1..N-1 of a torchrun-launched learner: their settings from the command line."""
    p = argparse.ArgumentParser(prog="kiln-learner (follower rank)")
    p.add_argument("--config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--instance")
    args = p.parse_args(argv)
    follower(load_config(LearnerConfig, args.config, args.overrides))


def follower(cfg: LearnerConfig) -> None:
    """Ranks 1..N-1 of a multi-rank learner: no bus, no database; rank 0 drives them."""
    logging.basicConfig(
        level=cfg.telemetry.log_level,
        format=f"%(asctime)s %(levelname)s learner-rank{os.environ['RANK']} %(name)s: %(message)s",
    )
    world = join(cfg)
    policy = Policy(cfg, load_suite(cfg.tasks.suite), world)
    follow(world, policy, Checkpointer(checkpoint_root(cfg), keep=cfg.learner.checkpoint.keep))
    dist.destroy_process_group()
