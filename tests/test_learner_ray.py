"""The learner service with ``learner.launcher.kind = "ray"``: its process is rank 0 (bus,
database, health) and rank 1 runs as an actor of a real Ray cluster, a head started by
``ray start --head`` on loopback with token auth. The run trains the same policy as the
single-process learner on the same data, survives a SIGKILL of the learner (the restarted
learner starts fresh Ray ranks and resumes from the whole-state checkpoint), and leaves
the cluster as it found it (every actor and placement group gone). A Ray rank that dies
under a live learner fails the learner (exit non-zero, for its supervisor to restart it)
instead of leaving it serving with a broken world.

Same data and tolerances as ``test_learner_resume.test_two_rank_learner_trains_like_one``
(the torchrun path), whose ``one_run`` drives both runs."""

from __future__ import annotations

import asyncio
import os
import re
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
from harness import InProcessPlatform, experiment, wait_for
from test_learner_resume import STEPS, assert_trains_like_one, one_run

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
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=2",
        "--num-gpus=0",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp}",
        f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
    ]
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


def test_kiln_run_starts_a_ray_learner_as_one_process():
    """``kiln run`` (and the tests above) start the learner by its registered argv: one
    plain process under Ray, torchrun for a local multi-rank world."""
    from kiln.learner.config import LearnerConfig
    from kiln.shared.config import load_config
    from kiln.shared.registry import discover

    info = discover()["learner"]
    ray_cfg = load_config(LearnerConfig, overrides=["learner.parallelism.ep=2", "learner.launcher.kind=ray"])
    assert info.argv(ray_cfg) == [sys.executable, "-m", info.module]
    local = info.argv(load_config(LearnerConfig, overrides=["learner.parallelism.ep=2"]))
    assert local[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in local


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_ray_launched_learner_trains_like_one_process(tmp_path, nats_server, bus, pg_url, ray_head):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    single, _, _, _ = await one_run(tmp_path / "a", nats_server, bus, pg_url, kill_after=None)
    multi, groups, run, logs = await one_run(
        tmp_path / "b",
        nats_server,
        bus,
        pg_url,
        kill_after=2,
        learner_settings={
            "parallelism": {"ep": 2},
            "launcher": {"kind": "ray", "address": ray_head, "rendezvous_host": "127.0.0.1"},
        },
    )
    # Rank 1's log reaches the learner's through Ray (log_to_driver), once per learner process.
    assert logs.count("rank 1 of 2 following rank 0") == 2, logs[-3000:]
    assert "restored the learner's state" in logs
    assert run.status == "finished" and len([g for g in groups if g.status == "trained"]) == STEPS * 2
    assert_trains_like_one(single, multi, tmp_path / "a")
    # The killed learner's actor and the finished one's placement group are gone.
    await wait_for(
        lambda: asyncio.to_thread(lambda: _idle_cpus(ray_head) == 2.0), 120, 1.0, "the Ray cluster's 2 CPUs free again"
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_a_lost_ray_rank_fails_the_learner(tmp_path, nats_server, bus, pg_url, ray_head):
    exp = experiment(
        tmp_path,
        nats_server.url,
        pg_url,
        run={"id": "ray-lost", "dir": str(tmp_path), "seed": 0},
        algorithm={"steps": STEPS, "groups_per_step": 2, "samples_per_group": 2},
        # rendezvous_host left empty: rank 0's address as Ray sees it (loopback here).
        learner={
            "tokenizer_corpus_repeats": 1,
            "parallelism": {"ep": 2},
            "launcher": {"kind": "ray", "address": ray_head},
        },
    )
    platform = InProcessPlatform(exp)
    await platform.start("weights")
    argv = platform.services["learner"].argv(platform.config("learner"))
    log = tmp_path / "learner.log"
    proc = subprocess.Popen(
        [*argv, "--config", str(exp), "--instance", "learner-lost"],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "KILN_CONFIG": str(exp)},
        start_new_session=True,
    )
    text = lambda: log.read_text(errors="replace")  # noqa: E731
    try:
        follower = await wait_for(
            lambda: re.search(r"\(_Rank pid=(\d+)\)[^\n]*rank 1 of 2 following rank 0", text()),
            180,
            0.2,
            "rank 1 following",
        )
        await wait_for(lambda: "kiln.learner: policy:" in text(), 180, 0.2, "rank 0 serving")
        os.kill(int(follower.group(1)), signal.SIGKILL)  # rank 1's actor process, a child of our Ray head
        rc = await asyncio.to_thread(proc.wait, 180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        await platform.stop_all()
    assert rc != 0, text()[-3000:]
    assert "a Ray rank of the learner ended early" in text(), text()[-3000:]
    await wait_for(
        lambda: asyncio.to_thread(lambda: _idle_cpus(ray_head) == 2.0), 120, 1.0, "the Ray cluster's 2 CPUs free again"
    )
