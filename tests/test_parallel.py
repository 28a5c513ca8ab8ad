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
import tempfile
import sys
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
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={dp * ep}", f"--master-port={port}",
        str(Path(dist_step.__file__)), str(dp), str(ep), str(out),
    ]  # fmt: skip
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


@pytest.mark.timeout(300)
def test_mxfp8_dispatch_payloads(tmp_path, reference):
    """Expert parallelism with the tokens sent to the experts as MXFP8 (uint8 buffers over
    gloo): the step stays within quantization error of the exact one: the loss within 1%,
    and no parameter further than the 2 x lr an AdamW first step can move a weight whose
    tiny gradient changed sign; and it is not the exact step (the payload was FP8)."""
    out = tmp_path / "state.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           str(Path(dist_step.__file__)), "1", "2", str(out), "mxfp8"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
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
        num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
        _temp_dir=temp,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}},
    )  # fmt: skip
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
