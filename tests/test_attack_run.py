"""Reward attacks through a whole ``kiln run``: the smoke preset on the built-in
``fix-calc`` task only, with the ``scripted`` engine as the policy (a test double that
plays fixed tool calls; every other service is the real one: env-pool's sandboxes, the
clean room, the learner, the database, the dashboard).

Half the samples forge the runner's report events and exit; the other half swap the
code objects of the test functions (tests/attacks_in_process.py, both of which scored 1
before issue 30's runner). Every trajectory must be recorded with reward 0 and its
reason (``incomplete``, ``tampered``), never an infra error, and the dashboard's
integrity table must count them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attacks_in_process as inproc
import pytest
from fastapi.testclient import TestClient

from kiln.ops.dashboard.app import create_app
from kiln.ops.embedded import PostgresServer
from kiln.shared.db import Database
from kiln.shared.tasks import BUILTIN, load_suite

REPO = Path(__file__).resolve().parents[1]
KILN = [sys.executable, "-m", "kiln.ops.cli"]
CALC = load_suite("builtin").get("fix-calc")


def write_call(path: str, content: str) -> str:
    # one line (JSON escapes the content's newlines): `kiln run` writes its resolved
    # config.toml with basic strings, which cannot hold a raw newline
    return (
        "<tool_call>"
        + json.dumps({"name": "write_file", "arguments": {"path": path, "content": content}})
        + "</tool_call>"
    )


@pytest.mark.timeout(600)
def test_forged_events_and_swapped_code_score_zero_through_kiln_run(tmp_path):
    suite = tmp_path / "calc.jsonl"
    suite.write_text(
        next(line for line in BUILTIN.read_text().splitlines() if json.loads(line)["id"] == "fix-calc") + "\n"
    )
    bug = CALC.files["calc.py"]
    episodes = [
        ["I will make the tests pass." + write_call("calc.py", attack + bug), "Done."]
        for attack in (inproc.FORGE_EVENTS, inproc.SWAP_CODE)
    ]
    config = tmp_path / "attack.toml"
    config.write_text(
        f"include = [{json.dumps(str(REPO / 'configs' / 'smoke.toml'))}]\n\n"
        f"[run]\nroot = {json.dumps(str(tmp_path / 'runs'))}\n\n"
        f'[tasks]\nsuite = {json.dumps(str(suite))}\ntools = ["write_file"]\n\n'
        "[algorithm]\nsteps = 2\n\n"
        '[rollout]\nengine = "scripted"\nmax_new_tokens = 1536\nmax_total_tokens = 4096\n\n'
        f"[rollout.scripted]\nepisodes = {json.dumps(episodes)}\n"
    )
    proc = subprocess.run(
        [*KILN, "run", "--config", str(config)], capture_output=True, text=True, timeout=540, cwd=REPO
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run_dir = next((tmp_path / "runs").iterdir())

    pg = PostgresServer(run_dir / "db" / "pg").start()  # the run's own embedded database
    try:
        import asyncio

        from sqlalchemy import select

        from kiln.shared.db import TrajectoryRecord

        db = Database(pg.url)

        async def rows():
            async with db.session() as s:
                return (await s.execute(select(TrajectoryRecord))).scalars().all()

        trajectories = asyncio.run(rows())
        with TestClient(create_app(db)) as client:
            api = client.get(f"/api/runs/{run_dir.name}").json()
            page = client.get(f"/runs/{run_dir.name}").text
    finally:
        pg.stop()
    scored = [t for t in trajectories if t.reward is not None]
    assert len(scored) >= 8, [(t.trajectory_id, t.reward, t.failure) for t in trajectories]
    wrong = [
        (t.trajectory_id, t.reward, t.failure, t.failure_detail)
        for t in scored
        if t.reward != 0.0 or t.infra_error or t.failure not in ("incomplete", "tampered")
    ]
    assert not wrong, wrong
    failures = {t.failure for t in scored}
    assert failures == {"incomplete", "tampered"}, failures  # both attacks were played, both scored 0
    swapped = next(t for t in scored if t.failure == "tampered")
    assert any("code of TestCalc.test_add_positive was replaced" in x for x in swapped.integrity["tampered"]), (
        swapped.integrity
    )
    # the dashboard's integrity table counts them per version, with each failure reason
    assert sum(row["tampered"] for row in api["integrity"]) == sum(t.failure == "tampered" for t in scored)
    assert api["failures"]["tampered"] >= 1 and api["failures"]["incomplete"] >= 1, api["failures"]
    assert "tampered:" in page and "incomplete:" in page
