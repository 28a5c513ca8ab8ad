"""The dashboard's pages and API over a real (SQLite) database written the way the
services write it: curves from ``steps`` rows, evaluations, the staleness histogram
from trajectory versions, a trajectory rendered turn by turn, token auth. The
browser test of a real finished run is in ``test_main_command``."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from kiln.ops.dashboard import create_app
from kiln.ops.dashboard.plots import histogram, line_chart
from kiln.shared import contracts as c
from kiln.shared.db import Database, EvalRecord, Run, StepRecord, TrajectoryRecord, upgrade


@pytest.fixture
async def db(tmp_path):
    url = f"sqlite:///{tmp_path / 'kiln.db'}"
    upgrade(url)
    d = Database(url)
    async with d.session() as s:
        s.add(Run(id="r1", name="tiny", status="finished", config={}))
        s.add(Run(id="r2", name="empty", config={}))
    async with d.session() as s:
        for step in range(3):
            m = c.StepMetrics(
                run_id="r1",
                step=step,
                version=step + 1,
                groups=2,
                trajectories=8,
                mean_reward=0.1 * step,
                pass_rate=0.25 * step,
                loss=0.01,
                infra_errors=0,
                dropped_groups=0,
                mean_staleness=0.5,
                max_staleness=1,
                step_seconds=2.0,
                wait_seconds=1.0 + step,
                tokens=900,
                elapsed_seconds=4.0 * (step + 1),
                generated_tokens=300,
                off_policy_tokens=100,
                clip_frac=0.05 * step,
                kl=0.002,
                grad_norm=0.5,
                lr=1e-4,
            )
            s.add(
                StepRecord(
                    run_id="r1",
                    step=step,
                    version=m.version,
                    trajectories=8,
                    mean_reward=m.mean_reward,
                    pass_rate=m.pass_rate,
                    loss=m.loss,
                    mean_staleness=0.5,
                    max_staleness=1,
                    step_seconds=2.0,
                    wait_seconds=m.wait_seconds,
                    elapsed_seconds=m.elapsed_seconds,
                    metrics=m.model_dump(mode="json"),
                )
            )
        s.add(
            EvalRecord(
                run_id="r1",
                version=0,
                suite="builtin",
                split="test",
                tasks=4,
                samples=4,
                seed=0,
                greedy_pass_rate=0.25,
                pass_at_k={"1": 0.2, "4": 0.5},
                per_task={},
            )
        )
        s.add(
            EvalRecord(
                run_id="r1",
                version=3,
                suite="builtin",
                split="test",
                tasks=4,
                samples=4,
                seed=0,
                greedy_pass_rate=0.75,
                pass_at_k={"1": 0.6, "4": 1.0},
                per_task={},
            )
        )
        for i, (vmin, trained) in enumerate([(0, 1), (0, 2), (1, 2), (2, 3)]):
            s.add(
                TrajectoryRecord(
                    trajectory_id=f"g{i}-s0",
                    run_id="r1",
                    group_id=f"g{i}",
                    task_id="fix-calc",
                    sample_index=0,
                    dispatch_version=vmin,
                    min_version=vmin,
                    max_version=vmin,
                    reward=1.0 if i % 2 else 0.0,
                    passed=bool(i % 2),
                    num_tokens=50,
                    num_generated=20,
                    num_turns=2,
                    finish_reason="no_tool_call",
                    trained_version=trained,
                    tests={"test_add": "passed"},
                    reward_terms={"tests": 1.0},
                    test_output="1 passed <script>x</script>",
                    failure={0: "tests_failed", 2: "tampered"}.get(i),
                    touched_protected=i == 0,
                    tampered=i == 2,
                    integrity={"protected": {"test_calc.py": "test file test_calc.py"}} if i == 0 else {},
                    trace_id="ab" * 16,
                    messages=[
                        {"role": "system", "content": "You fix bugs."},
                        {"role": "user", "content": "fix calc.py"},
                        {
                            "role": "assistant",
                            "content": "Reading <b>it</b>",
                            "version": vmin,
                            "tool_calls": [{"id": "call_0", "name": "read_file", "arguments": {"path": "calc.py"}}],
                        },
                        {"role": "tool", "content": "def add(a, b): ...", "tool_call_id": "call_0"},
                    ],
                )
            )
    yield d
    await d.close()


def test_run_page_plots_every_curve_from_the_database(db):
    with TestClient(create_app(db)) as client:
        runs = client.get("/").text
        assert 'data-run="r1"' in runs and 'data-run="r2"' in runs
        page = client.get("/runs/r1").text
        reward = re.search(r'<svg data-plot="reward".*?</svg>', page, re.S).group(0)
        assert re.findall(r'data-x="([^"]+)" data-y="([^"]+)"', reward)[:3] == [("1", "0"), ("2", "0.1"), ("3", "0.2")]
        evals = re.search(r'<svg data-plot="eval".*?</svg>', page, re.S).group(0)
        assert (
            'data-series="greedy"' in evals and 'data-series="pass@4"' in evals and 'data-x="3" data-y="0.75"' in evals
        )
        update = re.search(r'<svg data-plot="update".*?</svg>', page, re.S).group(0)
        assert 'data-series="clip fraction"' in update and 'data-x="3" data-y="0.1"' in update
        idle = re.search(r'<svg data-plot="idle".*?</svg>', page, re.S).group(0)
        assert 'data-x="1" data-y="0.333333"' in idle  # waited 1 s of 3
        stale = re.search(r'<svg data-plot="staleness".*?</svg>', page, re.S).group(0)
        # trained into v+1 from tokens of v: staleness 0, three times; one of 1
        assert dict(re.findall(r'data-bin="(\d+)" data-count="(\d+)"', stale)) == {"0": "3", "1": "1"}
        assert "no data yet" in client.get("/runs/r2").text
        assert client.get("/runs/nope").status_code == 404
        api = client.get("/api/runs/r1").json()
        assert [s["version"] for s in api["steps"]] == [1, 2, 3] and api["staleness"] == {"0": 3, "1": 1}
        # reward hacking shows per version: who touched protected files, who tampered
        assert api["integrity"] == [
            {"version": 0, "scored": 2, "touched_protected": 1, "tampered": 0, "failed": 1},
            {"version": 1, "scored": 1, "touched_protected": 0, "tampered": 1, "failed": 1},
            {"version": 2, "scored": 1, "touched_protected": 0, "tampered": 0, "failed": 0},
        ]
        assert api["failures"] == {"tests_failed": 1, "tampered": 1}
        assert '<tr data-version="1"><td>1</td><td>1</td>' in page and "tampered: 1" in page
        integrity = re.search(r'<svg data-plot="integrity".*?</svg>', page, re.S).group(0)
        assert 'data-series="touched protected"' in integrity and 'data-x="1" data-y="1"' in integrity
        detail = client.get("/runs/r1/trajectories/g0-s0").text
        assert "tests_failed" in detail and "<code>test_calc.py</code> (test file test_calc.py)" in detail


def test_trajectory_page_renders_turns_escaped(db):
    with TestClient(create_app(db)) as client:
        page = client.get("/runs/r1/trajectories/g1-s0").text
        assert re.findall(r'class="turn (\w+)" data-role', page) == ["system", "user", "assistant", "tool"]
        assert (
            "Reading &lt;b&gt;it&lt;/b&gt;" in page and "<script>x</script>" not in page
        )  # model text is never markup
        assert 'data-tool="read_file"' in page and "policy version 0" in page and "ab" * 16 in page
        assert client.get("/runs/r2/trajectories/g1-s0").status_code == 404  # another run's trajectory


def test_token_guards_every_route(db):
    with TestClient(create_app(db, token="s3cret")) as client:
        assert client.get("/").status_code == 401 and client.get("/api/runs").status_code == 401
        assert client.get("/", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_empty_charts_say_so():
    assert "no data yet" in line_chart("x", "X", [], xlabel="v") and "no data yet" in histogram(
        "h", "H", {}, xlabel="v"
    )


def test_span_tree_from_trace_files(tmp_path):
    import json

    from kiln.ops.dashboard.traces import span_tree

    def span(name, sid, parent, t, service, trace="ab" * 16):
        return json.dumps(
            {
                "name": name,
                "context": {"trace_id": f"0x{trace}", "span_id": sid},
                "parent_id": parent,
                "start_time": f"2026-12-03T06:00:0{t}.000000Z",
                "end_time": f"2026-12-03T06:00:0{t}.500000Z",
                "attributes": {},
                "resource": {"attributes": {"service.name": service}},
            }
        )

    (tmp_path / "learner.jsonl").write_text(
        span("controller.dispatch", "0x1", None, 0, "kiln-learner")
        + "\n"
        + span("other", "0x9", None, 0, "kiln-learner", trace="cd" * 16)
        + "\n"
    )
    (tmp_path / "rollout.jsonl").write_text(
        span("rollout.generate", "0x3", "0x2", 2, "kiln-rollout")
        + "\n"
        + span("rollout.trajectory", "0x2", "0x1", 1, "kiln-rollout")
        + "\n"
        + span("orphan", "0x5", "0x4", 3, "kiln-rollout")
        + "\n"
    )
    roots = span_tree(tmp_path, "ab" * 16)
    assert [r.name for r in roots] == ["controller.dispatch", "orphan"]  # a lost parent does not hide a span
    assert [c.name for c in roots[0].children] == ["rollout.trajectory"]
    assert roots[0].children[0].children[0].name == "rollout.generate" and roots[0].ms == 500
