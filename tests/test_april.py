"""Active partial rollouts (APRIL) through the whole platform: a real nats-server, a real
database, real sandboxes, the learner training the tiny policy, and the ``sim`` engine
(long-tailed lengths, exact per-token versions) so that aborts really hit samples in
the middle of a generation.

What must hold: every dispatched group ends once (trained or dropped with a reason);
suspended samples resume under the next version with their earlier tokens kept
(``partial_rollout = true``) or are regenerated from scratch (``false``: no token of an
aborted generation reaches the learner); a group older than ``max_staleness`` never
trains."""

from __future__ import annotations

import pytest
from harness import InProcessPlatform, experiment, wait_run_ended
from sqlalchemy import select

from kiln.shared import contracts as c
from kiln.shared.db import Database, Run, StepRecord, TaskGroup, TrajectoryRecord

# Generations of about a second, with a tail of several (p90 ~ 4 s), against learner steps
# of about a second: when a batch fills, other groups are still generating, so aborts
# really hit samples mid-generation (with 0.1 s generations they had all finished).
SIM = {"length_median": 40.0, "length_sigma": 1.2, "step_s": 0.02, "max_batch": 64, "load_s": 0.02}


async def _dropped_log(bus, run_id: str) -> list[c.GroupDropped]:
    sub = await bus.js.pull_subscribe(c.GROUP_DROPPED, stream=c.stream_for_subject(c.GROUP_DROPPED).name)
    out = []
    while True:
        try:
            msgs = await sub.fetch(100, timeout=1)
        except Exception:  # nats' fetch raises a timeout once the stream is drained
            return out
        out += [m for m in (c.GroupDropped.from_bytes(x.data) for x in msgs) if m.run_id == run_id]


async def _april_run(nats_server, bus, pg_url, run_dir, max_dropped_groups=100, reward=None, **algorithm):
    exp = experiment(
        run_dir,
        nats_server.url,
        pg_url,
        algorithm={
            "mode": "april",
            "steps": 4,
            "groups_per_step": 2,
            "samples_per_group": 2,
            "overprovision": 2.0,
            "max_staleness": 2,
            "group_deadline_s": 120,
            **algorithm,
        },
        rollout={"engine": "sim", "sim": SIM, "concurrent_groups": 8, "max_turns": 1, "max_new_tokens": 400},
        learner={"max_dropped_groups": max_dropped_groups, "deadline_check_s": 0.5},
        **({"reward": reward} if reward else {}),
    )
    platform = InProcessPlatform(exp)
    run_id = platform.config("learner").run.id
    db = Database(pg_url)
    try:
        await platform.start_all()

        await wait_run_ended(platform, db, run_id, 240)
        health = await bus.request(f"{c.HEALTH_PREFIX}.rollout", c.HealthProbe(), c.HealthReply)
        async with db.session() as s:
            run = await s.get(Run, run_id)
            groups = (await s.scalars(select(TaskGroup).where(TaskGroup.run_id == run_id))).all()
            trajs = (await s.scalars(select(TrajectoryRecord).where(TrajectoryRecord.run_id == run_id))).all()
    finally:
        await platform.stop_all()
        await db.close()
    assert run.status == "finished", run.detail
    for g in groups:
        assert g.status in ("trained", "dropped"), f"{g.group_id} never ended"
        assert g.status == "trained" or g.reason, f"{g.group_id} dropped without a reason"
    assert sum(g.status == "trained" for g in groups) == 4 * 2
    trained = [t for t in trajs if t.trained_version is not None]
    assert len({t.trajectory_id for t in trajs}) == len(trajs)
    return groups, trained, health.detail


@pytest.mark.timeout(300)
async def test_april_suspends_and_resumes_partials_under_the_next_version(nats_server, bus, pg_url, run_dir):
    groups, trained, health = await _april_run(nats_server, bus, pg_url, run_dir)
    assert health["suspended"] > 0 and health["resumed"] > 0, health
    # More groups were dispatched than trained: the over-provisioned ones are suspended, not wasted.
    assert len(groups) > 4 * 2
    # Some trained samples span two versions: begun under v, finished under v+1 after a suspension.
    assert any(t.min_version < t.max_version for t in trained), [(t.min_version, t.max_version) for t in trained]
    for t in trained:
        assert t.trained_version - 1 - t.min_version <= 2  # max_staleness, counted from the oldest token
        assert t.max_version <= t.trained_version - 1


@pytest.mark.timeout(300)
async def test_partial_rollout_false_discards_aborted_tokens(nats_server, bus, pg_url, run_dir):
    # max_staleness 0: nothing new is generated under an old version (no overlap with the
    # learner's step), so a kept token of an aborted generation would be stale (rollout
    # would abandon its group); discarded, the sample starts again under the new version.
    groups, trained, health = await _april_run(
        nats_server, bus, pg_url, run_dir, partial_rollout=False, max_staleness=0
    )
    assert health["suspended"] > 0 and health["abandoned"] == 0, health
    # Regenerated from scratch: every trained sample was generated under one version.
    for t in trained:
        assert t.min_version == t.max_version == t.trained_version - 1, (t.trajectory_id, t.min_version, t.max_version)


@pytest.mark.timeout(300)
async def test_group_older_than_max_staleness_never_trains(nats_server, bus, pg_url, run_dir):
    # max_staleness 0: a resumed partial is one version old, so it is abandoned, never trained.
    groups, trained, health = await _april_run(nats_server, bus, pg_url, run_dir, max_staleness=0)
    assert health["abandoned"] > 0, health
    stale = [g for g in groups if g.reason == "stale"]
    assert stale and all("versions old" in g.detail for g in stale)
    for t in trained:
        assert t.min_version == t.max_version == t.trained_version - 1


def _rewards_by_group(trajs) -> dict[str, set[float]]:
    out: dict[str, set[float]] = {}
    for t in trajs:
        if t.purpose == "train" and t.reward is not None and not t.infra_error:
            out.setdefault(t.group_id, set()).add(t.reward)
    return out


@pytest.mark.timeout(300)
async def test_uniform_groups_are_replaced_up_to_the_budget(nats_server, bus, pg_url, run_dir):
    # Every sim sample fails its tests (reward 0), so every group is uniform: each step drops
    # exactly 2 as no_signal and replaces them, then trains uniform ones (the run still ends),
    # and those drops do not count against max_dropped_groups (1 here).
    groups, trained, _ = await _april_run(
        nats_server, bus, pg_url, run_dir, max_dropped_groups=1, uniform_group_retries=2
    )
    filtered = [g for g in groups if g.reason == "no_signal"]
    assert len(filtered) == 2 * 4, [(g.group_id, g.reason) for g in groups if g.status == "dropped"]
    assert all(g.detail == "all 2 samples scored 0.0" for g in filtered)
    assert {t.trained_version for t in trained} == {1, 2, 3, 4}
    # ...and each reached the dropped-log exactly once, as every drop must
    logged = [m.group_id for m in await _dropped_log(bus, groups[0].run_id) if m.reason == "no_signal"]
    assert sorted(logged) == sorted(g.group_id for g in filtered)
    db = Database(pg_url)
    try:
        async with db.session() as s:
            steps = (await s.scalars(select(StepRecord).where(StepRecord.run_id == groups[0].run_id))).all()
    finally:
        await db.close()
    # each step's metrics count the groups dropped while its batch filled
    assert sum(st.metrics["dropped_groups"] for st in steps) >= 2 * 4, [st.metrics["dropped_groups"] for st in steps]


@pytest.mark.timeout(300)
async def test_groups_with_signal_are_never_filtered(nats_server, bus, pg_url, run_dir):
    # A length penalty makes the two samples of a group score differently: nothing is uniform,
    # so nothing is dropped as no_signal, and every trained group's rewards differ.
    reward = {"shaping": {"generated_tokens_k": -0.1}}
    groups, trained, _ = await _april_run(nats_server, bus, pg_url, run_dir, reward=reward, uniform_group_retries=4)
    assert not [g for g in groups if g.reason == "no_signal"]
    by_group = _rewards_by_group(trained)
    assert by_group and all(len(r) == 2 for r in by_group.values()), by_group
