"""Held-out evaluation through the real services (nats-server, PostgreSQL, env-pool
sandboxes, reward running the tests, an eval worker = rollout with ``role = eval``):
a run with ``eval.every = 1`` records one ``evaluations`` row per version, its episodes
ran under exactly the version they evaluate (while training moved on) and never reach
the learner; evaluating the same version again reproduces its greedy episodes token for
token; pass@k is the unbiased estimator."""

from __future__ import annotations

import pytest
from harness import InProcessPlatform, experiment, wait_for, wait_run_ended
from sqlalchemy import select

from kiln.shared import contracts as c
from kiln.shared.config import EvalSettings
from kiln.shared.db import Database, EvalRecord, Run, TrajectoryRecord
from kiln.shared.evaluation import EvalCollector, pass_at_k
from kiln.shared.tasks import load_suite

EVAL = {"every": 1, "split": "heldout", "max_tasks": 2, "samples": 2, "k": [1, 2], "seed": 7, "timeout_s": 120}


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k failures: some draw of k passes
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 4)


async def test_an_evaluation_nothing_answers_is_not_recorded(bus, tmp_path):
    from kiln.shared.db import upgrade

    url = f"sqlite:///{tmp_path / 'kiln.db'}"
    upgrade(url)
    db = Database(url)
    try:
        async with db.session() as s:
            s.add(Run(id="r", name="r", config={}))
        weights = c.WeightsPublished(
            run_id="r",
            version=0,
            step=0,
            path=str(tmp_path),
            manifest_sha256="0" * 64,
            manifest=c.WeightsManifest(run_id="r", version=0, step=0, parent_version=None, files=[], tensors={}),
        )
        collector = EvalCollector(bus, db, load_suite("builtin"))
        await collector.watch()
        await collector.start("r", "r-eval-v0", weights, EvalSettings(**{**EVAL, "timeout_s": 0.2}), "builtin")

        async def expired():  # no eval worker: nothing comes back, and the 0.2 s run out
            await collector.expire()
            return not collector.outstanding()

        await wait_for(expired, 30, 0.05, "the evaluation expired")
        assert await collector.wait("r-eval-v0", 1) is None and not collector.outstanding()
        async with db.session() as s:
            assert (await s.scalars(select(EvalRecord))).all() == []
    finally:
        await db.close()


@pytest.mark.timeout(300)
async def test_run_evaluates_every_version_under_exactly_that_version(nats_server, bus, pg_url, run_dir):
    exp = experiment(
        run_dir,
        nats_server.url,
        pg_url,
        eval=EVAL,
        algorithm={
            "steps": 2,
            "groups_per_step": 2,
            "samples_per_group": 2,
            "max_staleness": 1,
            "group_deadline_s": 120,
        },
    )
    platform = InProcessPlatform(exp)
    run_id = platform.config("learner").run.id
    published: dict[int, c.WeightsPublished] = {}

    async def on_weights(m: c.WeightsPublished) -> None:
        published[m.version] = m

    await bus.watch(c.weights_published_subject(run_id), c.WeightsPublished, on_weights, deliver="all")
    db = Database(pg_url)
    try:
        for name in ("env-pool", "weights", "reward", "rollout"):
            await platform.start(name)
        await platform.start("rollout", instance="rollout-eval", rollout={"role": "eval"})
        await platform.start("learner", wait_ready=False)

        await wait_run_ended(platform, db, run_id, 240)
        async with db.session() as s:
            assert (await s.get(Run, run_id)).status == "finished"
            evals = (
                await s.scalars(select(EvalRecord).where(EvalRecord.run_id == run_id).order_by(EvalRecord.version))
            ).all()
            trajs = (await s.scalars(select(TrajectoryRecord).where(TrajectoryRecord.run_id == run_id))).all()

        # --- one evaluation per version, each complete
        assert [e.version for e in evals] == [0, 1, 2]
        for e in evals:
            assert e.tasks == 2 and e.samples == 2 and e.split == "heldout" and set(e.pass_at_k) == {"1", "2"}
            assert all(
                t["missing"] == 0 and t["samples"] == 2 and t["greedy"] is not None for t in e.per_task.values()
            ), e.per_task
        # --- eval episodes ran under the version they evaluate, and never trained
        ev = [t for t in trajs if t.purpose == "eval"]
        assert len(ev) == 3 * 2 * (1 + 2)
        for t in ev:
            version = int(t.eval_id.rsplit("-v", 1)[1])
            assert t.trained_version is None
            if t.num_generated:
                assert t.min_version == t.max_version == version, (t.trajectory_id, t.min_version, t.max_version)
        assert all(t.purpose == "train" for t in trajs if t.trained_version is not None)

        # --- evaluating version 2 again (the workers are idle now) reproduces its greedy episodes
        collector = EvalCollector(bus, db, load_suite("builtin"))
        await collector.watch()
        await collector.start(run_id, f"{run_id}-eval-again-v2", published[2], EvalSettings(**EVAL), "builtin")
        again = await collector.wait(f"{run_id}-eval-again-v2", 120)
        assert again.version == 2 and again.greedy_pass_rate == evals[2].greedy_pass_rate
        async with db.session() as s:
            rows = (
                await s.scalars(
                    select(TrajectoryRecord).where(
                        TrajectoryRecord.eval_id.in_([f"{run_id}-eval-v2", f"{run_id}-eval-again-v2"])
                    )
                )
            ).all()
        greedy = {}
        for t in rows:
            if "-greedy-" in t.trajectory_id:
                greedy.setdefault(t.task_id, []).append([m["content"] for m in t.messages])
        assert len(greedy) == 2 and all(len(v) == 2 and v[0] == v[1] for v in greedy.values()), greedy
    finally:
        await platform.stop_all()
        await db.close()
