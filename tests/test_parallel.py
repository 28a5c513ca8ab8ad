"""Expert parallelism + FSDP2 on CPU (gloo, 2 and 4 processes under torchrun): one
training step gives the loss, and after the step the full parameters, of a
single-process step on the same batch.

Tolerance: fp32; the parallel step only reorders float sums (per-rank partial sums,
all-to-all then reduce-scatter), so the loss agrees to 1e-6 relative and every
parameter to 5e-6 absolute after one AdamW step of lr 1e-3 (a wrong shard, a gradient
counted twice or a missing expert would be off by ~1e-3). Not tighter: AdamW's first step
moves a weight by lr * g / (|g| + eps), which for a gradient near eps turns the rounding
of a reordered sum into up to ~1e-3 of lr (CI measured 1.17e-6 once)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import dist_step  # noqa: E402

from kiln.learner.parallel import policy_gradient_step  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    m = dist_step.model()
    b = dist_step.batch()
    stats = policy_gradient_step(m, dist_step.optimizer(m), b, global_tokens=int(b["mask"].sum()), **dist_step.HPARAMS)
    return stats, {k: v.detach().clone() for k, v in m.named_parameters()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,ep", [(1, 2), (2, 1), (2, 2), (1, 4)])
def test_parallel_step_equals_single_process(tmp_path, reference, dp, ep):
    out = tmp_path / "state.pt"
    port = 29500 + (os.getpid() * 7 + dp * 10 + ep) % 2000
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={dp * ep}",
        f"--master-port={port}",
        str(Path(dist_step.__file__)),
        str(dp),
        str(ep),
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
    ref_stats, ref_state = reference
    assert got["stats"]["loss"] == pytest.approx(ref_stats["loss"], rel=1e-6, abs=1e-7)
    assert got["stats"]["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5)
    assert got["state"].keys() == ref_state.keys()
    worst = max((got["state"][k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst < 5e-6, worst
    moved = max((ref_state[k] - dist_step.model().state_dict()[k]).abs().max().item() for k in ref_state)
    assert moved > 1e-4  # the step did change the parameters


def torchrun(tmp_path, nproc: int, *args: str) -> dict:
    out = tmp_path / "state.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
        str(Path(dist_step.__file__)),
        *args[:2],
        str(out),
        *args[2:],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.timeout(300)
def test_collectives_stay_on_the_training_device(tmp_path):
    """Every collective of a step (expert all-to-alls, FSDP, the load-balancing statistics,
    the gradient norm, the step statistics) moves tensors on the training device. The
    second of two (dp=2, ep=2) steps runs with the default device set to ``meta`` and
    collectives that refuse tensors off the training device: a tensor built without being
    placed on the training device lands on ``meta`` and is refused, as NCCL refuses a CPU
    tensor on a GPU (``dist_step.py``). The steps
    also equal two single-process steps (nothing ``meta`` leaked into the numbers): each
    tensor within 1e-3 of how far it moved (float summation order, amplified by AdamW)."""
    got = torchrun(tmp_path, 4, "2", "2", "hp", "strict")
    m, v0 = dist_step.model(), dist_step.model().state_dict()
    opt = dist_step.optimizer(m)
    for seed in (0, 1):
        b = dist_step.batch(seed)
        stats = policy_gradient_step(m, opt, b, global_tokens=int(b["mask"].sum()), **dist_step.HPARAMS)
    assert got["stats"]["loss"] == pytest.approx(stats["loss"], rel=1e-5, abs=1e-7)
    assert got["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
    ref = dict(m.named_parameters())
    for k, t in got["state"].items():
        moved = (ref[k].detach() - v0[k]).norm()
        assert moved > 0, k
        assert (t - ref[k].detach()).norm() <= 1e-3 * moved, k


@pytest.mark.timeout(300)
def test_mxfp8_dispatch_payloads(tmp_path, reference):
    """Expert parallelism with the tokens sent to the experts as MXFP8 (uint8 buffers over
    gloo): the step stays within quantization error of the exact one: the loss within 1%,
    and no parameter further than the 2 x lr an AdamW first step can move a weight whose
    tiny gradient changed sign; and it is not the exact step (the payload was FP8)."""
    got = torchrun(tmp_path, 2, "1", "2", "mxfp8")
    ref_stats, ref_state = reference
    assert got["stats"]["loss"] == pytest.approx(ref_stats["loss"], rel=1e-2)
    worst = max((got["state"][k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert 1e-7 < worst <= 2e-3 + 1e-6, worst


@pytest.mark.timeout(300)
def test_ray_launcher_runs_the_same_step(tmp_path, reference, monkeypatch):
    """The Ray launcher (placement group, one actor per rank, its own rendezvous) runs
    the function torchrun runs, with the same result. Ray on loopback only."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from kiln.learner.launch import ray_launch

    tests_dir = str(Path(__file__).parent)
    temp = tempfile.mkdtemp(prefix="kr-")  # short: Ray's unix sockets live under it
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        _temp_dir=temp,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}},
    )
    try:
        out = tmp_path / "state.pt"
        losses = ray_launch(dist_step.run, 2, args=(1, 2, str(out)), env={"OMP_NUM_THREADS": "1"})
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    ref_stats, ref_state = reference
    assert losses == [pytest.approx(ref_stats["loss"], rel=1e-6)] * 2
    got = torch.load(out)
    assert max((got["state"][k] - ref_state[k]).abs().max().item() for k in ref_state) < 5e-6
