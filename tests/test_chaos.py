"""The chaos tool (``kiln chaos``, ``bench/chaos.py``): a real ``kiln run`` whose processes
are SIGKILLed at seeded moments of its progress (nats-server included) must finish with
every invariant of ``kiln.ops.chaos.invariants`` holding; and the checker itself must
fail on a run whose records are broken in each way it claims to detect, so that a chaos
run cannot pass vacuously."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import delete, update

from kiln.ops.chaos import invariants as inv
from kiln.ops.chaos.monkey import TARGETS, plan
from kiln.shared import contracts as c
from kiln.shared.db import Database, PolicyVersion, Run, StepRecord, TaskGroup, TrajectoryRecord, upgrade

REPO = Path(__file__).resolve().parents[1]
RUN = "fake"
# Short ack waits: a killed worker's unacked work comes back in seconds, not minutes
# (in-progress heartbeats keep slow work from being redelivered under a live worker).
FAST = [
    "--set",
    "nats.ack_wait_s.reward-workers=10",
    "--set",
    "nats.ack_wait_s.rollout-workers=10",
    "--set",
    "nats.ack_wait_s.learner=15",
    "--set",
    "nats.ack_wait_s.weights-writers=10",
    "--set",
    "local.restart_backoff_s=0.2",
]


def chaos(tmp_path: Path, *args: str, timeout: float) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "chaos.py"), "--root", str(tmp_path), *FAST, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    return out


def assert_survived(out: str, kills: int, targets: set[str]) -> None:
    assert f"kills survived: {kills} of {kills}" in out, out[-6000:]
    assert "groups lost: 0 " in out and "invariants: all hold" in out, out[-6000:]
    killed = {
        m.group(1) for m in re.finditer(r"^\| \d+ \| (\S+) \| \S+ \| \d+ \| \d+ \| [\d.]+ s \| [\d.]+ s \|$", out, re.M)
    }
    assert killed == targets, out[-6000:]
    # Each malformed message published on purpose is dead-lettered (twice if a kill lost the first ack), nothing else is.
    assert re.search(r"dead letters: (\d+) \(\1 deliberate, of 2 malformed messages", out), out[-6000:]


@pytest.mark.timeout(400)
def test_a_short_chaos_run_survives_kills_of_nats_and_services(tmp_path):
    out = chaos(
        tmp_path, "--steps", "4", "--kills", "3", "--targets", "nats,reward,rollout", "--seed", "3", timeout=380
    )
    assert_survived(out, 3, {"nats", "reward", "rollout"})


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_longer_chaos_run_survives_kills_of_every_target(tmp_path):
    out = chaos(tmp_path, "--steps", "12", "--kills", "8", "--seed", "5", timeout=1450)
    assert_survived(out, 8, set(TARGETS))


def test_the_plan_is_seeded_and_covers_every_target_before_repeating():
    a, b = plan(7, 8, list(TARGETS), 100), plan(7, 8, list(TARGETS), 100)
    assert [(k.target, k.at) for k in a] == [(k.target, k.at) for k in b]
    assert {k.target for k in a[: len(TARGETS)]} == set(TARGETS)
    assert [k.at for k in a] == sorted(k.at for k in a) and all(1 <= k.at <= 85 for k in a)
    assert [(k.target, k.at) for k in plan(8, 8, list(TARGETS), 100)] != [(k.target, k.at) for k in a]


# --- the checker fails on broken records -------------------------------------------------


def _version(store: Path, v: int) -> PolicyVersion:
    folder = store / RUN / f"v{v:06d}"
    folder.mkdir(parents=True)
    data = f"weights of version {v}".encode() * 10
    (folder / "w.bin").write_bytes(data)
    m = c.WeightsManifest(
        run_id=RUN,
        version=v,
        step=v,
        parent_version=v - 1 if v else None,
        files=[c.FileInfo(path="w.bin", size=len(data), sha256=hashlib.sha256(data).hexdigest())],
        tensors={},
    )
    body = m.model_dump_json(by_alias=True).encode()
    (folder / "manifest.json").write_bytes(body)
    return PolicyVersion(
        run_id=RUN,
        version=v,
        step=v,
        parent_version=m.parent_version,
        path=str(folder),
        manifest_sha256=hashlib.sha256(body).hexdigest(),
    )


async def fake_run(tmp_path: Path) -> str:
    """A consistent record of a 2-step run (1 group of 2 samples per step, one group dropped)."""
    url = f"sqlite:///{tmp_path / 'kiln.db'}"
    await asyncio.to_thread(upgrade, url)
    db = Database(url)
    now = datetime.now(UTC)
    try:
        async with db.session() as s:
            s.add(
                Run(
                    id=RUN,
                    name=RUN,
                    status="finished",
                    config={"algorithm": {"steps": 2, "groups_per_step": 1, "max_staleness": 0, "mode": "async"}},
                )
            )
            await s.flush()
            for v in range(3):
                s.add(_version(tmp_path / "store", v))
            for i, (status, reason, tv) in enumerate(
                [("trained", None, 1), ("trained", None, 2), ("dropped", "stale", None)]
            ):
                gid = f"{RUN}-g{i:06d}"
                dv = (tv or 1) - 1
                s.add(
                    TaskGroup(
                        group_id=gid,
                        run_id=RUN,
                        task_id="t",
                        n_samples=2,
                        dispatch_version=dv,
                        status=status,
                        reason=reason,
                        trained_version=tv,
                        deadline=now,
                    )
                )
                for k in range(2):
                    s.add(
                        TrajectoryRecord(
                            trajectory_id=f"{gid}-s{k}",
                            run_id=RUN,
                            group_id=gid,
                            task_id="t",
                            sample_index=k,
                            dispatch_version=dv,
                            min_version=dv,
                            max_version=dv,
                            trained_version=tv,
                        )
                    )
            for step in range(2):
                s.add(
                    StepRecord(
                        run_id=RUN,
                        step=step,
                        version=step + 1,
                        trajectories=2,
                        mean_reward=0,
                        pass_rate=0,
                        loss=0,
                        mean_staleness=0,
                        max_staleness=0,
                        step_seconds=1,
                        wait_seconds=1,
                        elapsed_seconds=1,
                    )
                )
    finally:
        await db.close()
    return url


async def _apply(url: str, *stmts) -> None:
    db = Database(url)
    try:
        async with db.session() as s:
            for st in stmts:
                await s.execute(st)
    finally:
        await db.close()


G1, T1 = f"{RUN}-g000001", f"{RUN}-g000001-s0"
BROKEN = {
    "a group never ended": (
        update(TaskGroup).where(TaskGroup.group_id == G1).values(status="dispatched", trained_version=None),
        r"still 'dispatched'",
    ),
    "a drop without a reason": (
        update(TaskGroup).where(TaskGroup.group_id == f"{RUN}-g000002").values(reason=None),
        r"dropped with reason None",
    ),
    "a token newer than its trainer": (
        update(TrajectoryRecord).where(TrajectoryRecord.trajectory_id == T1).values(max_version=2),
        r"newer than it",
    ),
    "a token staler than allowed": (
        update(TrajectoryRecord).where(TrajectoryRecord.trajectory_id == T1).values(min_version=0),
        r"max staleness 0",
    ),
    "a trained sample not stamped": (
        update(TrajectoryRecord).where(TrajectoryRecord.trajectory_id == T1).values(trained_version=None),
        r"rows are stamped",
    ),
    "a dropped group's sample stamped": (
        update(TrajectoryRecord).where(TrajectoryRecord.trajectory_id == f"{RUN}-g000002-s0").values(trained_version=2),
        r"its group is dropped",
    ),
    "a step without its batch": (
        update(TaskGroup).where(TaskGroup.group_id == G1).values(trained_version=1),
        r"version 2: 0 groups trained",
    ),
    "a step never recorded": (delete(StepRecord).where(StepRecord.step == 1), r"steps recorded \[0\]"),
    "a version missing": (delete(PolicyVersion).where(PolicyVersion.version == 1), r"policy versions \[0, 2\]"),
    "a manifest not the registered one": (
        update(PolicyVersion).where(PolicyVersion.version == 2).values(manifest_sha256="0" * 64),
        r"sha256 differs",
    ),
    "a gap in the dispatch sequence": (delete(TaskGroup).where(TaskGroup.group_id == G1), r"not the dispatch sequence"),
}


async def test_the_checker_passes_a_consistent_run(tmp_path):
    url = await fake_run(tmp_path)
    report = await inv.check_records(url, RUN)
    assert report.violations == [] and report.lost_groups == 0
    assert report.facts["versions_verified"] == 3 and report.facts["steps_recorded"] == 2


@pytest.mark.parametrize("broken", list(BROKEN))
async def test_the_checker_fails_a_broken_run(tmp_path, broken):
    url = await fake_run(tmp_path)
    stmt, says = BROKEN[broken]
    await _apply(url, stmt)
    report = await inv.check_records(url, RUN)
    assert any(re.search(says, v) for v in report.violations), report.violations


async def test_the_checker_fails_a_corrupted_version_file(tmp_path):
    url = await fake_run(tmp_path)
    f = tmp_path / "store" / RUN / "v000001" / "w.bin"
    f.write_bytes(b"X" * f.stat().st_size)  # same size, other bytes
    report = await inv.check_records(url, RUN)
    assert any("does not match its manifest sha256" in v for v in report.violations), report.violations


async def test_the_checker_counts_a_lost_group(tmp_path):
    url = await fake_run(tmp_path)
    await _apply(url, BROKEN["a group never ended"][0])
    assert (await inv.check_records(url, RUN)).lost_groups == 1


def test_the_host_check_finds_a_leftover_process_and_workspace(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    ws = tmp_path / "shm" / "env-pool-0-999999"
    ws.mkdir(parents=True)
    (run_dir / "logs" / "env-pool-0.log").write_text(
        f'{{"msg": "env-pool node env-pool-0 serving: backend bwrap, cgroups v1, capacity 4, workspaces in {ws}, HTTP on x"}}\n'
    )
    incarnations = inv.envpool_incarnations(run_dir, {"env-pool-0": {999998}})
    assert incarnations == {"env-pool-0-999999": {ws}, "env-pool-0-999998": set()}
    leftover = subprocess.Popen(["sleep", "300"], env={**os.environ, "KILN_CONFIG": str(run_dir / "config.toml")})
    try:
        found = inv.check_host(run_dir, incarnations).violations
        assert any(f"process {leftover.pid} of the run" in v for v in found), found
        assert any(f"workspace folder {ws}" in v for v in found), found
    finally:
        leftover.send_signal(signal.SIGKILL)
        leftover.wait()
    ws.rmdir()
    assert inv.check_host(run_dir, incarnations).violations == []


async def test_the_bus_check_tells_deliberate_dead_letters_from_others(tmp_path):
    from kiln.ops.embedded import NatsServer
    from kiln.shared.bus import Bus
    from kiln.shared.config import NatsSettings

    server = NatsServer(tmp_path / "nats").start()
    try:
        bus = await Bus.connect(NatsSettings(url=server.url), "test")
        await bus.ensure_topology()
        await bus.close()
    finally:
        server.stop()
    clean = await inv.check_bus(tmp_path / "nats", {}, set())  # empty streams: nothing to say
    assert clean.violations == [] and clean.facts["dead_letters"] == 0, clean.violations
    server = NatsServer(tmp_path / "nats").start()
    try:
        bus = await Bus.connect(NatsSettings(url=server.url), "test")
        dlq = f"{c.DEAD_LETTER_PREFIX}.{c.TRAJECTORY_SCORED}"
        await bus.js.publish(dlq, inv.BAD_INPUT_MARKER + b" m1 {not json", headers={c.HDR_DLQ_REASON: "invalid"})
        await bus.js.publish(
            dlq, b'{"real": 1}', headers={c.HDR_DLQ_REASON: "handler raised", c.HDR_DLQ_SERVICE: "learner"}
        )
        await bus.publish(c.GROUP_DROPPED, c.GroupDropped(run_id=RUN, group_id="g0", reason="stale"))
        await bus.publish(c.GROUP_DROPPED, c.GroupDropped(run_id=RUN, group_id="g1", reason="stale"))
        await bus.close()
    finally:
        server.stop()
    report = await inv.check_bus(tmp_path / "nats", {"g0": ("dropped", "stale"), "g1": ("trained", None)}, {"m1", "m2"})
    v = report.violations
    assert any("from learner: handler raised" in x for x in v), v
    assert any("1 deliberately malformed messages are not in KILN_DLQ: ['m2']" in x for x in v), v
    assert any(x.startswith("g1: the dropped-log says ['stale'], the database trained") for x in v), v
    assert not any(x.startswith("g0") for x in v), v
    assert report.facts["deliberate_dead_letters"] == 1


# --- found by chaos runs -------------------------------------------------------------------


async def test_a_learner_killed_after_its_commit_writes_the_steps_row_on_resume(tmp_path):
    """A learner SIGKILLed after a step's checkpoint was committed but before the step's
    ``steps`` row was written resumed without ever writing it (the run's record lacked a
    step it had trained: the checker's "steps recorded" invariant). The step's metrics now
    ride in the checkpoint and resume writes the row."""
    from types import SimpleNamespace

    from kiln.learner.config import LearnerConfig
    from kiln.learner.state import Checkpointer, Meta
    from kiln.learner.trainer import Trainer

    m = c.StepMetrics(
        run_id=RUN,
        step=2,
        version=3,
        groups=1,
        trajectories=2,
        mean_reward=0.5,
        pass_rate=0.5,
        loss=0.1,
        infra_errors=0,
        dropped_groups=0,
        mean_staleness=0,
        max_staleness=0,
        step_seconds=1,
        wait_seconds=1,
        tokens=10,
        elapsed_seconds=5,
    )
    # Through the checkpoint's meta.json, as a resumed learner reads it.
    ckpt = Checkpointer(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "step-000003").mkdir(parents=True)
    ckpt._commit(
        tmp_path / "ckpt" / "step-000003",
        Meta(step=3, version=3, trained_groups=["g"], metrics=m.model_dump(mode="json")),
    )
    meta = ckpt.latest()

    calls = []

    class Controller:  # the trainer's view of it: kiln.learner.ledger.TrainerLedger
        def last_published(self):
            return 2

        async def mark_trained(self, groups, trajs, version, *, resumed=False):
            calls.append(("trained", groups, version, resumed))

        async def step_finished(self, version, metrics, *, resumed=False):
            if metrics is not None:
                calls.append(("step", metrics))
            calls.append(("recorded", version))

    class Bus:
        async def publish(self, subject, msg, **kw):
            calls.append(("publish", subject))

    class Policy:
        def stage(self, folder):
            folder.mkdir(parents=True)
            (folder / "model.safetensors").write_bytes(b"x")

    cfg = LearnerConfig(run={"id": RUN, "dir": str(tmp_path)})
    trainer = Trainer(SimpleNamespace(config=cfg, bus=Bus()), Controller(), Policy())
    await trainer.resume(meta)
    assert calls == [("publish", c.WEIGHTS_CHECKPOINT), ("trained", ["g"], 3, True), ("step", m), ("recorded", 3)]
