"""The learner on a multi-rank world: rank 0 serves, the other ranks follow.

With ``learner.parallelism.dp_shard * ep > 1`` the learner process is started by torchrun
(``kiln run`` does it, see ``command``), or, with ``learner.launcher.kind = "ray"``, it is
started alone and starts ranks 1.. as Ray actors itself (``start_ray_ranks``). Every rank builds the same
policy (tokenizer and weights from ``run.seed``) and shards it (expert parallelism +
FSDP2, ``kiln.learner.parallel``). Only rank 0 talks to NATS and the database; it drives
the others with commands broadcast on a gloo control group: ``step`` (the padded batch
tensors), ``checkpoint`` (save the whole state, each rank its shards), ``stage`` (gather
the full parameters for a version folder) and ``stop``.

Invariants: every collective the policy runs is entered by all ranks in the same order,
because rank 0 announces each one before entering it and followers do nothing else; a
follower whose rank 0 died is ended by torchrun (it tears down the whole group). This
module imports neither the entrypoint (``main``) nor the followers' (``follower``):
``start_ray_ranks`` is handed the function the ranks run.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch.distributed as dist

from kiln.learner.parallel import Meshes, ParallelDims, init_distributed

log = logging.getLogger("kiln.learner.world")


@dataclass
class World:
    meshes: Meshes
    control: object
    """gloo group for command objects (NCCL cannot broadcast Python objects on CPU)."""

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def size(self) -> int:
        return dist.get_world_size()

    def announce(self, *command) -> None:
        """Rank 0: tell the followers what to enter next."""
        dist.broadcast_object_list([command], src=0, group=self.control)

    def receive(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def dims_of(cfg) -> ParallelDims:
    return ParallelDims(dp_shard=cfg.learner.parallelism.dp_shard, ep=cfg.learner.parallelism.ep)


def join(cfg) -> World | None:
    """The world this process belongs to (None: a single-process learner)."""
    dims = dims_of(cfg)
    if dims.world == 1:
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) != dims.world:
        raise RuntimeError(
            f"learner.dp_shard x learner.ep = {dims.world} ranks, but this process is not one of "
            f"{dims.world} launched ranks (WORLD_SIZE={os.environ.get('WORLD_SIZE')}); start it with "
            "`torchrun --nproc-per-node N -m kiln.learner.main` or `kiln run`"
        )
    meshes = init_distributed(dims)
    return World(meshes, dist.new_group(backend="gloo"))


def follow(world: World, policy, checkpointer) -> None:
    """A follower rank's life: run what rank 0 announces until it says stop."""
    log.info("rank %d of %d following rank 0", world.rank, world.size)
    while True:
        command = world.receive()
        kind = command[0]
        if kind == "step":
            policy.step_tensors(command[1])
        elif kind == "checkpoint":
            checkpointer.save(policy.model, policy.optimizer, policy.scheduler, command[1], asynchronous=False)
        elif kind == "load":
            checkpointer.load(policy.model, policy.optimizer, policy.scheduler, command[1])
        elif kind == "stage":
            policy.full_state()
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown learner command {kind!r}")


def start_ray_ranks(cfg, follower):
    """Rank 0 of a Ray-launched world: connect to the cluster at ``learner.launcher.address``
    and start ``follower(cfg)`` (``kiln.learner.follower.follower``) on ranks 1..
    (``kiln.learner.launch.ray_followers``). The followers get the resolved settings
    without the bus and database credentials, which only rank 0 uses. ``follower`` must
    be a function of an importable module, not of ``__main__``: Ray pickles the one by
    reference, the other by value."""
    import ray

    from kiln.learner.launch import ray_followers

    lc = cfg.learner
    if not ray.is_initialized():
        ray.init(address=lc.launcher.address, log_to_driver=True)
    shipped = cfg.model_copy(
        update={
            "nats": cfg.nats.model_copy(update={"user": "", "password": ""}),
            "database": cfg.database.model_copy(update={"url": ""}),
        }
    )
    return ray_followers(
        follower,
        dims_of(cfg).world,
        args=(shipped,),
        cpus_per_rank=lc.launcher.cpus_per_rank,
        gpus_per_rank=lc.launcher.gpus_per_rank,
        strategy=lc.launcher.strategy,
        env={"OMP_NUM_THREADS": str(lc.torch_threads)},
        master_addr=lc.launcher.rendezvous_host,
        master_port=lc.launcher.rendezvous_port,
    )


def command(cfg, module: str) -> list[str]:
    """argv prefix ``kiln run`` uses to start the learner: torchrun for a multi-rank world
    (the Ray launcher starts its own ranks from the one process)."""
    n = dims_of(cfg).world
    if n == 1 or cfg.learner.launcher.kind == "ray":
        return [sys.executable, "-m", module]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--standalone", "-m", module]
