"""vLLM's weight-transfer path (``weights.transport.kind = "vllm-nccl"``): what both
sides agree on (tensor order, dtypes, rendezvous), which engine each broadcast path
feeds, and, where two GPUs and a CUDA build of vLLM are lent, a version sent by the
weights service's sender and served by a real vLLM engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from harness import experiment
from safetensors.torch import load_file
from test_weights import checkpoints

from kiln.ops.embedded import free_port
from kiln.rollout.config import RolloutConfig
from kiln.rollout.main import check_broadcast
from kiln.shared.config import load_config
from kiln.shared.weights.manifest import build_manifest
from kiln.shared.weights.transport.vllm_nccl import rendezvous, update_info


def test_update_info_follows_the_manifest_in_sorted_order(tmp_path):
    staged = checkpoints(tmp_path, 1)[0]
    m = build_manifest(staged, run_id="r", version=0, step=0, parent_version=None)
    info = update_info(m)
    tensors = load_file(str(staged / "model.safetensors"))
    assert info["names"] == sorted(tensors) and len(info["names"]) == len(m.tensors)
    for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
        assert getattr(torch, dtype) == tensors[name].dtype and shape == list(tensors[name].shape)
    m.tensors[info["names"][0]].dtype = "C64"
    with pytest.raises(ValueError, match="cannot carry"):
        update_info(m)


def test_rendezvous_is_tcp_host_and_port():
    assert rendezvous("tcp://10.0.0.5:29600") == ("10.0.0.5", 29600)
    for bad in ("env://", "tcp://host", "file:///tmp/x"):
        with pytest.raises(ValueError, match="tcp://host:port"):
            rendezvous(bad)


@pytest.mark.parametrize(
    ("engine", "backend", "error"),
    [
        ("vllm", "vllm-nccl", None),
        ("torch", "gloo", None),
        ("torch", "nccl", None),
        ("vllm", "nccl", "use broadcast_backend = 'vllm-nccl'"),
        ("torch", "vllm-nccl", "feeds rollout.engine = 'vllm'"),
        ("sim", "gloo", "feeds rollout.engine = 'torch'"),
    ],
)
def test_each_broadcast_path_feeds_its_engine(tmp_path, engine, backend, error):
    exp = experiment(
        tmp_path,
        "nats://127.0.0.1:4222",
        "sqlite://",
        rollout={"engine": engine},
        weights={
            "transport": {
                "init_method": "tcp://127.0.0.1:29600",
                "world_size": 2,
                **(
                    {"kind": "vllm-nccl"} if backend == "vllm-nccl" else {"kind": "torch-broadcast", "backend": backend}
                ),
            }
        },
    )
    cfg = load_config(RolloutConfig, exp)
    if error is None:
        check_broadcast(cfg)
    else:
        with pytest.raises(ValueError, match=error):
            check_broadcast(cfg)


def _cuda_vllm() -> bool:
    if torch.cuda.device_count() < 2:
        return False
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cuda()


SENDER = textwrap.dedent("""
    import sys
    from safetensors.torch import load_file
    from kiln.shared.weights.manifest import build_manifest
    from kiln.shared.weights.transport.vllm_nccl import VllmTransferSender
    init, folder = sys.argv[1], sys.argv[2]
    sender = VllmTransferSender(init, 2)
    m = build_manifest(__import__("pathlib").Path(folder), run_id="r", version=1, step=1, parent_version=0)
    print(sender.send(m, load_file(folder + "/model.safetensors")), flush=True)
""")

ENGINE = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    from kiln.shared.weights.manifest import build_manifest
    from kiln.shared.weights.transport.vllm_nccl import update_info, worker_init_info
    from kiln.rollout.config import VllmSettings
    from kiln.rollout.vllm_engine import VllmEngine
    init, v0, v1 = sys.argv[1], sys.argv[2], sys.argv[3]
    async def main():
        e = VllmEngine(VllmSettings(dtype="float32", max_model_len=512, gpu_memory_utilization=0.3), "t", transfer=True)
        await e.load(0, Path(v0))
        await e.join_transfer(worker_init_info(init, 1, 2))
        await e.receive_transfer(1, update_info(build_manifest(Path(v1), run_id="r", version=1, step=1, parent_version=0)))
        g = await e.generate(list(range(10, 30)), 16, set(), 0.7, seed=3)
        print(json.dumps({"version": e.version, "tokens": g.token_ids, "logprobs": g.logprobs, "versions": g.versions}))
        await e.close()
    asyncio.run(main())
""")


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not _cuda_vllm(),
    reason="vLLM's NCCL weight transfer needs 2 CUDA GPUs (sender and engine on their own) and a CUDA build of vLLM; this machine has neither",
)
def test_a_version_sent_over_vllm_nccl_is_served_by_the_engine(tmp_path):
    from kiln.shared.model.checkpoint import load_checkpoint
    from kiln.shared.model.moe import sequence_logprobs

    staged = checkpoints(tmp_path, 2, change=1.0)
    init = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ)
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, init, str(staged[1])],
        env={**env, "CUDA_VISIBLE_DEVICES": "0"},
        stdout=subprocess.PIPE,
        text=True,
    )
    engine = subprocess.run(
        [sys.executable, "-c", ENGINE, init, str(staged[0]), str(staged[1])],
        env={**env, "CUDA_VISIBLE_DEVICES": "1"},
        capture_output=True,
        text=True,
        timeout=500,
    )
    sent = sender.communicate(timeout=60)[0]
    assert engine.returncode == 0 and sender.returncode == 0, engine.stderr[-3000:]
    assert int(sent.strip().splitlines()[-1]) > 0
    out = json.loads(engine.stdout.strip().splitlines()[-1])
    assert out["version"] == 1 and out["versions"] == [1] * len(out["tokens"])
    # The engine samples from version 1's weights: its logprobs are version 1's own.
    model = load_checkpoint(staged[1]).eval()
    ids = torch.tensor([list(range(10, 30)) + out["tokens"]])
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), 0.7)
    ref = lp[0, 20:].tolist()
    assert max(abs(a - b) for a, b in zip(out["logprobs"], ref)) < 2e-3
