"""The accounting invariant after faults: a rollout worker process killed mid-group,
its sandboxes leaked until their leases expire (so env-pool runs out and samples fail
as infra errors), and a broken environment that must end the run instead of looping.
Every dispatched group still ends exactly once, trained or dropped with a reason."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
from harness import InProcessPlatform, experiment, wait_for
from sqlalchemy import select

from kiln.shared import contracts as c
from kiln.shared.db import Database, Run, TaskGroup, TrajectoryRecord


async def _groups_and_run(db: Database, run_id: str):
    async with db.session() as s:
        groups = (await s.scalars(select(TaskGroup).where(TaskGroup.run_id == run_id))).all()
        trajs = (await s.scalars(select(TrajectoryRecord).where(TrajectoryRecord.run_id == run_id))).all()
        run = await s.get(Run, run_id)
    return groups, trajs, run


@pytest.mark.timeout(240)
async def test_killed_rollout_worker_and_exhausted_pool(nats_server, bus, pg_url, run_dir):
    exp = experiment(
        run_dir,
        nats_server.url,
        pg_url,
        algorithm={"steps": 2, "groups_per_step": 2, "samples_per_group": 2, "group_deadline_s": 20},
        nats={"ack_wait_s": {"rollout-workers": 3.0}},
        envpool={"max_sandboxes": 3, "reap_interval_s": 0.5},
        # The victim's leases run out 1 s after its group's deadline: the reaper frees them.
        rollout={"sandbox_score_buffer_s": 1.0, "max_turns": 2, "max_new_tokens": 64},
    )
    platform = InProcessPlatform(exp)
    run_id = platform.config("learner").run.id
    db = Database(pg_url)
    victim = None
    try:
        await platform.start("env-pool")
        await platform.start("weights")
        await platform.start("reward")
        victim = subprocess.Popen(
            [sys.executable, "-m", "kiln.rollout.main", "--config", str(exp), "--instance", "rollout-victim"],
            stdout=open(run_dir / "victim.log", "wb"),
            stderr=subprocess.STDOUT,
            # Long turns (~3 s each here) keep the victim inside its first group long enough
            # for the poll below to see it: with 64-token turns a fast machine finished the
            # whole run between two polls.
            env={**os.environ, "KILN_CONFIG": str(exp), "KILN_ROLLOUT__MAX_NEW_TOKENS": "1500"},
        )
        await platform.start("learner", wait_ready=False)

        async def victim_mid_group():
            health = await bus.request(f"{c.HEALTH_PREFIX}.env-pool", c.HealthProbe(), c.HealthReply)
            return health.detail.get("live", 0) >= 2  # both of its samples hold a sandbox

        await wait_for(victim_mid_group, 90, 0.05, "the doomed worker is inside a group")
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        await platform.start("rollout", instance="rollout-survivor")

        async def finished():
            assert not platform.failed(), platform.failed()
            _, _, run = await _groups_and_run(db, run_id)
            return run is not None and run.status != "running"

        await wait_for(finished, 180, 0.5, "run ended")
        groups, trajs, run = await _groups_and_run(db, run_id)
        assert run.status == "finished", run.detail
        for g in groups:
            assert g.status in ("trained", "dropped"), f"{g.group_id} never ended"
            assert g.status == "trained" or g.reason, f"{g.group_id} dropped without a reason"
        assert sum(g.status == "trained" for g in groups) == 2 * 2
        assert (await bus.consumer_info(c.ROLLOUT_WORKERS)).delivered.consumer_seq > len(groups), (
            "nothing was redelivered"
        )
        for t in trajs:
            if t.trained_version is not None and t.num_generated:
                assert t.min_version == t.max_version == t.trained_version - 1
        # the victim's leaked sandboxes filled the pool until their leases expired
        assert any(t.infra_error and "pool_exhausted" in t.infra_error for t in trajs)
        # the survivor finished what the victim had started: all its samples are recorded once
        assert len({t.trajectory_id for t in trajs}) == len(trajs)
    finally:
        if victim and victim.poll() is None:
            victim.kill()
        await platform.stop_all()
        await db.close()


@pytest.mark.timeout(120)
async def test_broken_environment_fails_the_run_with_its_reason(nats_server, pg_url, run_dir):
    exp = experiment(
        run_dir,
        nats_server.url,
        pg_url,
        envpool={"max_sandboxes": 0},  # every sandbox request fails: every sample is an infra error
        learner={"max_dropped_groups": 3, "deadline_check_s": 0.5},
    )
    platform = InProcessPlatform(exp)
    run_id = platform.config("learner").run.id
    db = Database(pg_url)
    try:
        await platform.start_all()
        learner = next(r for r in platform.running if r.name == "learner")
        await asyncio.wait_for(asyncio.shield(learner.task), 90)
    except RuntimeError as e:
        assert "failed" in str(e) and "infra_error" in str(e) and "pool exhausted" in str(e)
    else:
        raise AssertionError("the learner should have failed the run")
    finally:
        platform.running = [r for r in platform.running if r.name != "learner"]
        await platform.stop_all()
    groups, _, run = await _groups_and_run(db, run_id)
    await db.close()
    assert run.status == "failed" and "pool exhausted" in run.detail
    assert all(g.status == "dropped" for g in groups)
    reasons = sorted(g.reason for g in groups)
    assert reasons.count("infra_error") == 4  # the limit is 3: the fourth drop ends the run
    assert set(reasons) <= {"infra_error", "run_finished"}, reasons


@pytest.mark.timeout(180)
async def test_a_dead_engine_stops_its_worker_and_its_work_goes_to_another(
    nats_server, bus, pg_url, run_dir, monkeypatch
):
    """A rollout worker whose engine dies (vLLM's core crashed) exits with the reason and
    hands its group back; it does not fail every request it takes until they are all
    dead-lettered. Another replica trains the run to the end."""
    import kiln.rollout.main as rollout_main
    from kiln.rollout.engine import EngineDead, TorchEngine
    from kiln.shared.service import ServiceFailed

    class DyingEngine(TorchEngine):
        async def generate(self, *a, **kw):
            raise EngineDead("engine core died (test)")

    make_engine = rollout_main.make_engine
    monkeypatch.setattr(
        rollout_main,
        "make_engine",
        lambda cfg, instance: DyingEngine() if instance == "rollout-doomed" else make_engine(cfg, instance),
    )
    exp = experiment(
        run_dir, nats_server.url, pg_url, algorithm={"steps": 1, "groups_per_step": 2, "samples_per_group": 2}
    )
    platform = InProcessPlatform(exp)
    run_id = platform.config("learner").run.id
    db = Database(pg_url)
    try:
        for name in ("env-pool", "weights", "reward"):
            await platform.start(name)
        doomed = await platform.start("rollout", instance="rollout-doomed")
        await platform.start("learner", wait_ready=False)
        with pytest.raises(ServiceFailed, match="rollout-doomed failed: engine core died"):
            await asyncio.wait_for(asyncio.shield(doomed.task), 90)
        platform.running.remove(doomed)
        await platform.start("rollout", instance="rollout-healthy")

        async def finished():
            assert not platform.failed(), platform.failed()
            _, _, run = await _groups_and_run(db, run_id)
            return run is not None and run.status != "running"

        await wait_for(finished, 120, 0.5, "run ended")
        groups, _, run = await _groups_and_run(db, run_id)
        assert run.status == "finished", run.detail
        assert sorted(g.status for g in groups) == ["trained", "trained"]
        info = await bus.js.stream_info("KILN_DLQ")
        assert info.state.messages == 0, "work of the dead engine was dead-lettered"
    finally:
        await platform.stop_all()
        await db.close()
