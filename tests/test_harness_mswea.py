"""mini-swe-agent, installed unmodified from PyPI in a virtualenv of its own
(scripts/setup-mini-swe-agent.sh), as a command harness: its model calls go to the
episode's endpoint (through litellm, as it ships), its shell commands run in a real
env-pool sandbox through kiln's environment class and the exec bridge, and reward
scores the result. Every trained token is one the engine generated, with the logprob
and version it reported."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_harness import Scripted, run

from kiln.rollout.config import HarnessSettings

REPO = Path(__file__).resolve().parents[1]
BASH = {"type": "function", "function": {"name": "bash"}}


def bash_call(command: str) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def mswea_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("mswea") / "venv"
    subprocess.run([str(REPO / "scripts" / "setup-mini-swe-agent.sh"), str(venv)], check=True, timeout=900)
    return venv


async def test_mini_swe_agent_fixes_the_task_in_the_sandbox(envpool, mswea_venv, monkeypatch):
    monkeypatch.chdir(REPO)  # KILN_WORKDIR: where the harness script is
    engine = Scripted(
        [
            "Let me fix the bug." + bash_call("sed -i 's/a - b/a + b/' calc.py && cat calc.py"),
            "Done." + bash_call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
        ]
    )
    harness = HarnessSettings(
        kind="command",
        entry='bash "$KILN_WORKDIR/scripts/harness-mini-swe-agent.sh"',
        env={"KILN_MSWEA_VENV": str(mswea_venv)},
    )
    t = await run(envpool, engine, harness, deadline_s=300)
    assert t.finish_reason == "harness_done", t.harness_log
    assert "exit status: Submitted" in t.harness_log
    assert t.final_diff.changed == {"calc.py": "def add(a, b):\n    return a + b\n"}
    assert t.num_turns == 2 and not t.segments  # mini-swe-agent keeps its history: one trajectory
    trained = [(x, lp, v) for x, lp, v, m in zip(t.token_ids, t.logprobs, t.token_versions, t.loss_mask) if m]
    assert trained == [x for g in engine.generated for x in zip(*g)]
    # mini-swe-agent's own prompt reached the model, with its bash tool
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in t.messages[0].content + t.messages[1].content
    await envpool.destroy(t.sandbox)
    assert os.path.exists(mswea_venv / "bin" / "mini")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_mini_swe_agent_preset_trains(tmp_path, mswea_venv):
    """`kiln run --config configs/harness-mini-swe-agent.toml`: every service a process,
    mini-swe-agent driving every episode; reward scores them, the learner trains them."""
    import psycopg

    from kiln.ops.embedded import PostgresServer

    proc = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "kiln"),
            "run",
            "--config",
            str(REPO / "configs" / "harness-mini-swe-agent.toml"),
            "--set",
            f"run.root={tmp_path}",
            "--set",
            f'rollout.harness.env={{KILN_MSWEA_VENV = "{mswea_venv}"}}',
        ],
        capture_output=True,
        text=True,
        timeout=800,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    pg = PostgresServer(run_dir / "db" / "pg").start()
    try:
        with psycopg.connect(pg.url) as conn:
            rows = conn.execute(
                "SELECT finish_reason, num_turns, num_generated, trained_version, infra_error FROM trajectories"
            ).fetchall()
    finally:
        pg.stop()
    assert len(rows) == 4 and all(r[0] in ("harness_done", "harness_error") and r[4] is None for r in rows), rows
    assert all(r[3] in (1, 2) for r in rows) and any(r[2] > 0 for r in rows), rows
