"""Launching a distributed learner: torchrun on one machine, Ray across machines.

``torchrun_command`` is the local path (``torch.distributed.run`` sets the rendezvous
environment itself). ``ray_launch`` runs one actor per rank in a placement group (one
bundle per rank, packed or spread over nodes) and sets up the rendezvous itself: rank
0's actor picks a free port on its own node, every actor gets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` before the
rank function runs, so the function is the same one torchrun runs
(``init_process_group`` from the environment).

``ray_followers`` is the learner service's path (``learner.launcher = "ray"``): the
calling process stays rank 0 (it serves the bus, the database and its health where its
supervisor sees it) and ranks 1.. run as actors; rank 0's rendezvous address is this
process's, which the actors must reach.

Invariants: either every rank's result comes back, or the launch raises the first
rank's error and every actor and the placement group are removed. Actors a driver
started are removed with it when it dies (Ray's ownership), so a killed learner leaves
no ranks behind. An actor given GPUs sees only them (Ray narrows
``CUDA_VISIBLE_DEVICES``), so its ``LOCAL_RANK`` is the index among its own devices: 0.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
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
        return _free_port()

    def run(self, fn: Callable, env: dict[str, str], args: tuple, kwargs: dict) -> Any:
        import ray

        if ray.get_gpu_ids() and os.environ.get("CUDA_VISIBLE_DEVICES"):
            env = {**env, "LOCAL_RANK": "0"}  # its GPUs are the only ones it sees
        os.environ.update(env)
        return fn(*args, **kwargs)


def _placed_ranks(n: int, cpus_per_rank: float, gpus_per_rank: float, strategy: str) -> tuple[list, Any, list, list]:
    """``n`` rank actors, one per bundle of a placement group of ``n`` bundles: (actors,
    placement group, each actor's (node id, IP), each actor's (LOCAL_RANK,
    LOCAL_WORLD_SIZE) among the actors on its node). On failure nothing is left behind."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
    pg = placement_group([bundle] * n, strategy=strategy)
    actors: list = []
    try:
        ray.get(pg.ready(), timeout=300)
        actor = ray.remote(_Rank)
        actors = [
            actor.options(
                num_cpus=cpus_per_rank,
                num_gpus=gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(n)
        ]
        nodes = ray.get([a.node.remote() for a in actors])
    except BaseException:
        _release(actors, pg)
        raise
    by_node: dict[str, list[int]] = {}
    for i, (node_id, _) in enumerate(nodes):
        by_node.setdefault(node_id, []).append(i)
    local = [(by_node[node_id].index(i), len(by_node[node_id])) for i, (node_id, _) in enumerate(nodes)]
    return actors, pg, nodes, local


def _release(actors: list, pg: Any) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)


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

    ranks, pg, nodes, local = _placed_ranks(world, cpus_per_rank, gpus_per_rank, strategy)
    try:
        master_ip, port = nodes[0][1], ray.get(ranks[0].free_port.remote())
        calls = []
        for i, r in enumerate(ranks):
            rank_env = {
                **(env or {}),
                "RANK": str(i),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local[i][0]),
                "LOCAL_WORLD_SIZE": str(local[i][1]),
                "MASTER_ADDR": master_ip,
                "MASTER_PORT": str(port),
            }
            calls.append(r.run.remote(fn, rank_env, args, kwargs or {}))
        return ray.get(calls)
    finally:
        _release(ranks, pg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class RayRanks:
    """Ranks 1..world-1 of a world whose rank 0 is the calling process."""

    env: dict[str, str]
    """Rank 0's rendezvous environment (``ray_followers`` put it into ``os.environ``)."""
    refs: list
    """One result per actor rank, rank order."""
    actors: list
    pg: Any

    def futures(self) -> list:
        """``concurrent.futures`` of the ranks' results (to watch them from asyncio)."""
        return [r.future() for r in self.refs]

    def close(self, timeout: float = 60.0) -> list[Any]:
        """Wait up to ``timeout`` for the ranks to return (rank 0 told them to stop; 0: do
        not wait), then remove the actors and the placement group; raises the first
        rank's error."""
        import ray

        try:
            return ray.get(self.refs, timeout=timeout) if timeout > 0 else []
        finally:
            _release(self.actors, self.pg)


def ray_followers(
    fn: Callable,
    world: int,
    *,
    args: tuple = (),
    cpus_per_rank: float = 1,
    gpus_per_rank: float = 0,
    strategy: str = "PACK",
    env: dict[str, str] | None = None,
    master_addr: str = "",
    master_port: int = 0,
) -> RayRanks:
    """Start ``fn(*args)`` on ranks 1..``world``-1 of the connected Ray cluster (one actor
    each, a placement group of ``world``-1 bundles) and make this process rank 0: its
    ``os.environ`` gets the rendezvous (``MASTER_ADDR`` = ``master_addr`` or this
    machine's IP as Ray sees it). Returns without waiting: the ranks meet in
    ``init_process_group`` once rank 0 joins."""
    import ray

    if world < 2:
        raise ValueError(f"a world of {world} rank(s) has no followers")
    addr = master_addr or ray.util.get_node_ip_address()
    port = master_port or _free_port()
    base = {**(env or {}), "WORLD_SIZE": str(world), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
    actors, pg, _, local = _placed_ranks(world - 1, cpus_per_rank, gpus_per_rank, strategy)
    try:
        refs = [
            a.run.remote(
                fn,
                {**base, "RANK": str(i + 1), "LOCAL_RANK": str(local[i][0]), "LOCAL_WORLD_SIZE": str(local[i][1])},
                args,
                {},
            )
            for i, a in enumerate(actors)
        ]
    except BaseException:
        _release(actors, pg)
        raise
    own = {**(env or {}), **base, "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    os.environ.update(own)
    return RayRanks(own, refs, actors, pg)
