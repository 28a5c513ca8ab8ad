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
from harness import experiment, wait_for
from test_weights import checkpoints

from kiln.ops.embedded import free_port
from kiln.shared import contracts as c
from kiln.shared.db import Database, Run
from kiln.shared.weights.transport.torch_broadcast import BroadcastGroup, BroadcastSettings


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
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL broadcast needs 2 CUDA GPUs (one per rank); none here, the same code runs over gloo above",
)
def test_broadcast_over_nccl():
    assert _run(2, "nccl") == [(1, 1, True), (1, 2, True)]


async def test_weights_service_broadcasts_to_a_rollout_engine(nats_server, bus, pg_url, run_dir, tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    exp = experiment(
        run_dir,
        nats_server.url,
        pg_url,
        weights={
            "transport": {"kind": "torch-broadcast", "init_method": init, "world_size": 2, "backend": "gloo"},
        },
    )
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
            stdout=open(run_dir / f"{tag}.log", "wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )

    weights = service("kiln.weights.main", "weights-b")
    rollout = service("kiln.rollout.main", "rollout-b", "--set", "weights.transport.rank=1")
    staged = checkpoints(tmp_path, 2)
    try:
        await bus.publish(
            c.WEIGHTS_CHECKPOINT,
            c.PolicyCheckpoint(run_id=run_id, version=0, step=0, parent_version=None, path=str(staged[0])),
        )

        async def serving(v: int, via: str) -> bool:
            try:
                h = await bus.request(f"{c.HEALTH_PREFIX}.rollout", c.HealthProbe(), c.HealthReply, timeout=2)
            except Exception:
                return False
            return h.detail.get("version") == v and h.detail.get("weights_via") == via

        await wait_for(lambda: serving(0, "files"), 90, 0.3, "engine serves v0 (its files carry config and tokenizer)")
        await bus.publish(
            c.WEIGHTS_CHECKPOINT,
            c.PolicyCheckpoint(run_id=run_id, version=1, step=1, parent_version=0, path=str(staged[1])),
        )
        await wait_for(lambda: serving(1, "broadcast"), 60, 0.3, "engine serves v1 from the broadcast")
        assert "broadcast version 1 to 1 engines" in (run_dir / "weights-b.log").read_text()
    finally:
        for p in (rollout, weights):
            p.terminate()
        for p in (rollout, weights):
            p.wait(30)


async def test_a_feed_falls_back_to_files_and_never_goes_backwards(tmp_path):
    """The torch-broadcast feed: the first version comes as files; a later one the event
    marks as broadcast whose tensors never arrive is read from its files after
    ``fallback_s``; tensors that arrive afterwards for it, and any older event, change nothing."""
    from opentelemetry import trace
    from safetensors.torch import load_file
    from test_weights import published

    from kiln.rollout.engine import TorchEngine
    from kiln.shared.weights.transport import TorchBroadcastTransport, make_feed
    from kiln.weights.store import VersionStore

    staged = checkpoints(tmp_path, 3)
    store = VersionStore(tmp_path / "store", delta=False, keyframe_every=10)
    stored = [
        store.put(p, run_id="r", version=v, step=v, parent_version=v - 1 if v else None) for v, p in enumerate(staged)
    ]
    served: list[tuple[int, str]] = []
    t = TorchBroadcastTransport(
        kind="torch-broadcast", init_method="tcp://127.0.0.1:1", world_size=2, rank=1, fallback_s=0.2
    )
    feed = make_feed(
        t,
        TorchEngine(),
        run_id="r",
        tracer=trace.get_tracer("t"),
        on_served=lambda v, via: served.append((v, via)),
        cache_dir=tmp_path / "cache",
        delta=False,
    )
    await feed.on_published(published(stored[0], v=0).model_copy(update={"broadcast": True}))  # the first: files anyway
    assert served == [(0, "files")] and feed.tokenizer is not None
    await feed.on_published(published(stored[1], v=1).model_copy(update={"broadcast": True}))
    assert served == [(0, "files")], "a broadcast version waits for its tensors first"
    assert await feed.wait_for(1, timeout=60), "its files were not read after fallback_s"
    assert served == [(0, "files"), (1, "files")]
    await feed.on_tensors(1, load_file(str(staged[1] / "model.safetensors")))  # late tensors of a served version
    await feed.on_published(published(stored[0], v=0))
    assert served == [(0, "files"), (1, "files")] and feed.version == 1
    await feed.on_tensors(2, load_file(str(staged[2] / "model.safetensors")))
    assert served[-1] == (2, "broadcast") and feed.version == 2


def test_each_worker_gets_the_feed_its_transport_and_role_call_for(tmp_path):
    """An eval worker reads files whatever the transport (it holds no place in a group);
    vllm-nccl needs an engine that accepts in-place transfers."""
    from opentelemetry import trace

    from kiln.rollout.engine import TorchEngine
    from kiln.shared.weights.transport import FilesTransport, TorchBroadcastTransport, VllmNcclTransport, make_feed
    from kiln.shared.weights.transport.files import FilesFeed
    from kiln.shared.weights.transport.torch_broadcast import TorchBroadcastFeed

    group = {"init_method": "tcp://127.0.0.1:1", "world_size": 2}
    kw = dict(run_id="r", tracer=trace.get_tracer("t"), on_served=lambda v, via: None, cache_dir=tmp_path, delta=False)
    torch_t = TorchBroadcastTransport(kind="torch-broadcast", **group)
    assert type(make_feed(torch_t, TorchEngine(), **kw)) is TorchBroadcastFeed
    assert type(make_feed(torch_t, TorchEngine(), eval_worker=True, **kw)) is FilesFeed
    assert type(make_feed(FilesTransport(), TorchEngine(), **kw)) is FilesFeed
    vllm_t = VllmNcclTransport(kind="vllm-nccl", **group)
    assert type(make_feed(vllm_t, TorchEngine(), eval_worker=True, **kw)) is FilesFeed
    with pytest.raises(TypeError, match="in-place transfers"):
        make_feed(vllm_t, TorchEngine(), **kw)
