"""Launching a distributed learner: torchrun on one machine, Ray across machines.

``torchrun_command`` is the local path (``torch.distributed.run`` sets the rendezvous
environment itself). ``ray_launch`` runs one actor per rank in a placement group (one
bundle per rank, packed or spread over nodes) and sets up the rendezvous itself: rank
0's actor picks a free port on its own node, every actor gets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` before the
rank function runs, so the function is the same one torchrun runs
(``init_process_group`` from the environment).

Invariant: either every rank's result comes back, or the launch raises the first
rank's error and every actor and the placement group are removed.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any


def torchrun_command(nproc: int, script_or_module: list[str], *, master_port: int = 0) -> list[str]:
    """The command line that runs ``script_or_module`` (``["-m", "pkg.mod", ...]`` or a
    script path and its arguments) on ``nproc`` local ranks."""
    port = [f"--master-port={master_port}"] if master_port else ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *port, *script_or_module]


class _Rank:
    """One rank's process (a Ray actor)."""

    def node(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, fn: Callable, env: dict[str, str], args: tuple, kwargs: dict) -> Any:
        os.environ.update(env)
        return fn(*args, **kwargs)


def ray_launch(
    fn: Callable,
    world: int,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    cpus_per_rank: float = 1,
    gpus_per_rank: float = 0,
    strategy: str = "PACK",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world`` ranks of the connected Ray cluster
    (``ray.init`` first); returns each rank's result, rank order."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
    pg = placement_group([bundle] * world, strategy=strategy)
    ray.get(pg.ready(), timeout=300)
    actor = ray.remote(_Rank)
    ranks = [
        actor.options(
            num_cpus=cpus_per_rank,
            num_gpus=gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote()
        for i in range(world)
    ]
    try:
        nodes = ray.get([r.node.remote() for r in ranks])
        master_ip, port = nodes[0][1], ray.get(ranks[0].free_port.remote())
        local: dict[str, list[int]] = {}
        for i, (node_id, _) in enumerate(nodes):
            local.setdefault(node_id, []).append(i)
        calls = []
        for i, r in enumerate(ranks):
            peers = local[nodes[i][0]]
            rank_env = {
                **(env or {}),
                "RANK": str(i), "WORLD_SIZE": str(world), "LOCAL_RANK": str(peers.index(i)),
                "LOCAL_WORLD_SIZE": str(len(peers)), "MASTER_ADDR": master_ip, "MASTER_PORT": str(port),
            }  # fmt: skip
            calls.append(r.run.remote(fn, rank_env, args, kwargs or {}))
        return ray.get(calls)
    finally:
        for r in ranks:
            ray.kill(r)
        remove_placement_group(pg)
