"""The broadcast weight path (torch.distributed): one sender, several engines. Over gloo
on CPUs here, through the real weights and rollout services as separate processes; the
NCCL variant needs GPUs and skips itself without them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from kiln.shared import contracts as c
from kiln.shared.db import Database, Run
from kiln.shared.embedded import free_port
from kiln.shared.weights.transport.torch_broadcast import BroadcastGroup, BroadcastSettings

from harness import experiment, wait_for
from test_weights import checkpoints


def _tensors(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "model.embed_tokens.weight": torch.randn(50, 16, generator=g),
        "model.layers.0.mlp.gate.weight": torch.randn(4, 16, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(50, 16, generator=g),
    }


def _member(rank: int, world: int, init: str, backend: str, results) -> None:
    group = BroadcastGroup(BroadcastSettings(init, world, rank, backend, timeout_s=60))
    try:
        for version in (1, 2):
            if rank == 0:
                group.send("r", version, _tensors(version))
            else:
                run_id, v, got = group.receive()
                want = _tensors(version)
                ok = run_id == "r" and v == version and all(torch.equal(got[k], want[k].cpu()) for k in want)
                results.put((rank, v, ok))
    finally:
        group.close()


def _run(world: int, backend: str) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_member, args=(r, world, init, backend, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return sorted(results.get(timeout=5) for _ in range(2 * (world - 1)))


def test_broadcast_over_gloo():
    assert _run(3, "gloo") == [(1, 1, True), (1, 2, True), (2, 1, True), (2, 2, True)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL broadcast needs 2 CUDA GPUs (one per rank); none here, the same code runs over gloo above")
def test_broadcast_over_nccl():
    assert _run(2, "nccl") == [(1, 1, True), (1, 2, True)]


async def test_weights_service_broadcasts_to_a_rollout_engine(nats_server, bus, pg_url, run_dir, tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    exp = experiment(run_dir, nats_server.url, pg_url, weights={
        "transport": {"kind": "torch-broadcast", "init_method": init, "world_size": 2, "backend": "gloo"},
    })  # fmt: skip
    from kiln.shared.config import load_config
    from kiln.weights.config import WeightsConfig

    run_id = load_config(WeightsConfig, exp).run.id
    db = Database(pg_url)
    async with db.session() as s:
        s.add(Run(id=run_id, name="t"))
    await db.close()
    env = {**os.environ, "KILN_CONFIG": str(exp)}

    def service(module: str, tag: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", module, "--config", str(exp), "--instance", tag, *extra],
            stdout=open(run_dir / f"{tag}.log", "wb"), stderr=subprocess.STDOUT, env=env,
        )

    weights = service("kiln.weights.main", "weights-b")
    rollout = service("kiln.rollout.main", "rollout-b", "--set", "weights.transport.rank=1")
    staged = checkpoints(tmp_path, 2)
    try:
        await bus.publish(c.WEIGHTS_CHECKPOINT, c.PolicyCheckpoint(run_id=run_id, version=0, step=0, parent_version=None, path=str(staged[0])))

        async def serving(v: int, via: str) -> bool:
            try:
                h = await bus.request(f"{c.HEALTH_PREFIX}.rollout", c.HealthProbe(), c.HealthReply, timeout=2)
            except Exception:
                return False
            return h.detail.get("version") == v and h.detail.get("weights_via") == via

        await wait_for(lambda: serving(0, "files"), 90, 0.3, "engine serves v0 (its files carry config and tokenizer)")
        await bus.publish(c.WEIGHTS_CHECKPOINT, c.PolicyCheckpoint(run_id=run_id, version=1, step=1, parent_version=0, path=str(staged[1])))
        await wait_for(lambda: serving(1, "broadcast"), 60, 0.3, "engine serves v1 from the broadcast")
        assert "broadcast version 1 to 1 engines" in (run_dir / "weights-b.log").read_text()
    finally:
        for p in (rollout, weights):
            p.terminate()
        for p in (rollout, weights):
            p.wait(30)
