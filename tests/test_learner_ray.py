"""The learner service with ``learner.launcher = "ray"``: its process is rank 0 (bus,
database, health) and rank 1 runs as an actor of a real Ray cluster, a head started by
``ray start --head`` on loopback with token auth. The run trains the same policy as the
single-process learner on the same data, survives a SIGKILL of the learner (the restarted
learner starts fresh Ray ranks and resumes from the whole-state checkpoint), and leaves
the cluster as it found it (every actor and placement group gone).

Same data and tolerances as ``test_learner_resume.test_two_rank_learner_trains_like_one``
(the torchrun path), whose ``one_run`` drives both runs."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from harness import wait_for
from test_learner_resume import LR, STEPS, one_run

ray = pytest.importorskip("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(monkeypatch):
    """A Ray head on 127.0.0.1 (2 CPUs, token auth, every port of its own: another head
    on the machine keeps its defaults), stopped by its own PID, never ``ray stop``."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind loopback, not every interface
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(16))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    temp = tempfile.mkdtemp(prefix="kr-")  # short: Ray's unix sockets live under it
    port = _free_port()
    argv = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}",
        "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false",
        "--disable-usage-stats", f"--temp-dir={temp}", f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}",
    ]  # fmt: skip
    log = Path(temp) / "head.log"
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"ray start exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the Ray head did not start:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        proc.wait(60)
        shutil.rmtree(temp, ignore_errors=True)


def _idle_cpus(address: str) -> float:
    """The cluster's free CPUs, asked by a driver process of its own (a driver inside
    pytest would stay connected, and Ray reads its auth settings once per process)."""
    code = f"import ray; ray.init(address={address!r}, log_to_driver=False); print(ray.available_resources().get('CPU', 0.0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_ray_launched_learner_trains_like_one_process(tmp_path, nats_server, bus, pg_url, ray_head):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    single, _, _, _ = await one_run(tmp_path / "a", nats_server, bus, pg_url, kill_after=None)
    multi, groups, run, logs = await one_run(
        tmp_path / "b", nats_server, bus, pg_url, kill_after=2,
        learner_settings={"ep": 2, "launcher": "ray", "ray_address": ray_head, "rendezvous_host": "127.0.0.1"},
    )  # fmt: skip
    # Rank 1's log reaches the learner's through Ray (log_to_driver), once per learner process.
    assert logs.count("rank 1 of 2 following rank 0") == 2, logs[-3000:]
    assert "restored the learner's state" in logs
    assert run.status == "finished" and len([g for g in groups if g.status == "trained"]) == STEPS * 2
    start = load_file(str(tmp_path / "a" / "weights" / "resume-a" / "v000000" / "model.safetensors"))
    for k in single:
        moved, off = (single[k] - start[k]).norm().item(), (single[k] - multi[k]).norm().item()
        assert off <= 1e-3 * moved, (k, off, moved)
        assert (single[k] - multi[k]).abs().max().item() < 0.05 * LR, k
    # The killed learner's actor and the finished one's placement group are gone.
    await wait_for(lambda: asyncio.to_thread(lambda: _idle_cpus(ray_head) == 2.0), 120, 1.0, "the Ray cluster's 2 CPUs free again")
