"""reward against real env-pool sandboxes, a real nats-server and PostgreSQL: scores
from real test runs, infra errors kept apart from failures, idempotent re-delivery,
and a reward process killed mid-scoring whose message is redelivered to its successor."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import InProcessPlatform, experiment, reward_platform, wait_for
from sqlalchemy import select

from kiln.shared import contracts as c
from kiln.shared.db import Database, Run, TrajectoryRecord
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.tasks import load_suite

BASE = load_suite("builtin").get("fix-calc")


def write_suite(path, timeout_s: float = 30.0):
    t = BASE.model_copy(update={"timeout_s": timeout_s})
    path.write_text(json.dumps(t.model_dump()) + "\n")
    return str(path)


def trajectory(
    run_id: str, sandbox: c.SandboxRef | None, tid: str = "g1-s0", status=c.TrajectoryStatus.FINISHED, why=None
):
    return c.Trajectory(
        run_id=run_id,
        trajectory_id=tid,
        group_id="g1",
        task_id=BASE.id,
        sample_index=0,
        dispatch_version=0,
        status=status,
        infra_error=why,
        token_ids=[1, 2, 3],
        logprobs=[0.0, -1.0, -2.0],
        token_versions=[-1, 0, 0],
        loss_mask=[0, 1, 1],
        sandbox=sandbox,
    )


async def scored_messages(bus, n: int, timeout: float = 30.0) -> list[c.ScoredTrajectory]:
    """Take ``n`` scored trajectories the way the learner would (no learner runs here)."""
    await bus.ensure_consumer(c.LEARNER)
    sub = await bus.js.pull_subscribe_bind(durable=c.LEARNER.durable, stream=c.LEARNER.stream)
    out, end = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        try:
            msgs = await sub.fetch(n - len(out), timeout=1)
        except TimeoutError:  # nats-py raises its own subclass, or the plain one
            continue
        for m in msgs:
            out.append(c.ScoredTrajectory.model_validate_json(await bus._body(m)))  # claim-checked when large
            await m.ack()
    await sub.unsubscribe()
    return out


async def reward_on(nats_server, pg_url, run_dir, tasks: list, path, **sections) -> tuple[InProcessPlatform, str]:
    """env-pool and reward over a suite of ``tasks`` written to ``path``; (platform, run id)."""
    path.write_text("".join(json.dumps(t.model_dump()) + "\n" for t in tasks))
    return await reward_platform(run_dir, nats_server.url, pg_url, path, **sections)


async def add_run(db_url: str, run_id: str) -> None:
    db = Database(db_url)
    async with db.session() as s:
        s.add(Run(id=run_id, name="t"))
    await db.close()


@pytest.fixture
async def platform(nats_server, pg_url, run_dir, tmp_path):
    exp = experiment(
        run_dir,
        nats_server.url,
        pg_url,
        tasks={"suite": write_suite(tmp_path / "suite.jsonl", timeout_s=2.0)},
        reward={"shaping": {"malformed_tool_calls": -0.25}},
    )
    p = InProcessPlatform(exp)
    await add_run(pg_url, p.config("reward").run.id)
    yield p
    await p.stop_all()


FIX = c.WorkspaceDiff(changed={"calc.py": "def add(a, b):\n    return a + b\n"})


async def test_pass_fail_hang_infra_and_duplicates(platform, bus, pg_url):
    run_id = platform.config("reward").run.id
    await platform.start("env-pool")
    await platform.start("reward")
    pool = EnvPoolClient(bus)

    fixed = await pool.create(BASE.id)  # the agent fixed the bug
    await pool.tools(
        fixed, [c.ToolCall(id="1", name="edit_file", arguments={"path": "calc.py", "old": "a - b", "new": "a + b"})]
    )
    broken = await pool.create(BASE.id)  # untouched: the bug is still there
    cheat = await pool.create(BASE.id)  # "fixed" the tests instead of the code
    await pool.tools(
        cheat, [c.ToolCall(id="1", name="write_file", arguments={"path": "test_calc.py", "content": "print('ok')"})]
    )
    hang = await pool.create(BASE.id)  # the agent's code never returns
    await pool.tools(
        hang,
        [
            c.ToolCall(
                id="1",
                name="write_file",
                arguments={"path": "calc.py", "content": "def add(a, b):\n    while True: pass\n"},
            )
        ],
    )
    gone = c.SandboxRef(node_id=fixed.node_id, sandbox_id="sb-gone")

    cases = {
        "fixed": trajectory(run_id, fixed, tid="g1-fixed"),
        "broken": trajectory(run_id, broken, tid="g1-broken"),
        "cheat": trajectory(run_id, cheat, tid="g1-cheat"),
        "hang": trajectory(run_id, hang, tid="g1-hang"),
        "lost": trajectory(run_id, gone, tid="g1-lost"),  # sandbox gone, no diff: nothing to score
        "rebuilt": trajectory(run_id, gone, tid="g1-rebuilt").model_copy(
            update={"final_diff": FIX, "malformed_tool_calls": 2}
        ),
        "infra": trajectory(run_id, None, "g1-infra", c.TrajectoryStatus.INFRA_ERROR, "sandbox create failed"),
    }
    for name, t in cases.items():
        await bus.publish(c.TRAJECTORY_FINISHED, t, msg_id=t.trajectory_id)
    got = {s.trajectory.trajectory_id.removeprefix("g1-"): s for s in await scored_messages(bus, len(cases))}
    assert set(got) == set(cases)
    assert got["fixed"].reward == 1.0 and got["fixed"].passed and got["fixed"].infra_error is None
    assert got["fixed"].reward_terms == {"tests": 1.0, "malformed_tool_calls": 0.0}  # every configured term
    assert got["broken"].reward == 0.0 and not got["broken"].passed and got["broken"].infra_error is None
    assert got["broken"].tests[BASE.fail_to_pass[0]] == c.CaseStatus.FAILED
    assert got["broken"].failure == c.Failure.TESTS_FAILED and got["broken"].report["statuses"] == "FP"
    assert got["cheat"].reward == 0.0 and got["cheat"].infra_error is None  # tests restored before scoring
    assert got["cheat"].integrity.protected == {"test_calc.py": "test file test_calc.py"}
    assert got["hang"].reward == 0.0 and got["hang"].infra_error is None
    assert got["hang"].failure == c.Failure.TIMEOUT and "timeout" in got["hang"].failure_detail
    assert got["lost"].infra_error and "no diff" in got["lost"].infra_error
    r = got["rebuilt"]  # scored in a fresh sandbox with the diff applied; shaping kept apart
    assert r.rescored_from_diff and r.passed and r.reward_terms == {"tests": 1.0, "malformed_tool_calls": -0.5}
    assert r.reward == 0.5
    assert got["infra"].infra_error == "sandbox create failed"

    # Redelivering an already-scored trajectory republishes its record: nothing re-runs
    # (its sandbox is gone) and the learner sees it once (same Nats-Msg-Id).
    await bus.publish(c.TRAJECTORY_FINISHED, cases["fixed"], msg_id="g1-fixed-again")
    db = Database(pg_url)
    try:

        async def rows():
            async with db.session() as s:
                return (await s.scalars(select(TrajectoryRecord))).all()

        await wait_for(lambda: _consumer_idle(bus), 20, 0.2, "reward idle")
        recs = {r.trajectory_id: r for r in await rows()}
        assert len(recs) == len(cases) and recs["g1-fixed"].reward == 1.0 and recs["g1-lost"].infra_error
        assert recs["g1-rebuilt"].reward_terms == {"tests": 1.0, "malformed_tool_calls": -0.5}
        assert recs["g1-cheat"].touched_protected and recs["g1-cheat"].integrity["protected"] == {
            "test_calc.py": "test file test_calc.py"
        }
        assert recs["g1-hang"].failure == "timeout" and recs["g1-broken"].report["statuses"] == "FP"
        assert await scored_messages(bus, 1, timeout=2) == [], "the redelivery reached the learner twice"
        # the whole log of every scored run is kept, the record points at it
        logs = await bus.js.object_store("kiln-reward-logs")
        whole = (await logs.get(recs["g1-broken"].log_key)).data.decode()
        assert BASE.fail_to_pass[0].rsplit(".", 1)[1] in whole and "FAIL" in whole
    finally:
        await db.close()


def custom_reward(trajectory, results) -> float:
    """A user's reward function (a pure function of trajectory + test results)."""
    return 0.25 + 0.5 * results.passed(results.fail_to_pass[0])


@pytest.mark.parametrize("function,expected", [("fraction", 0.5), ("test_reward:custom_reward", 0.75)])
async def test_partial_credit_and_custom_functions(nats_server, bus, pg_url, run_dir, tmp_path, function, expected):
    task = BASE.model_copy(
        update={
            "id": "two-bugs",
            "files": {
                "calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a + b\n",
                "test_calc.py": (
                    "import unittest\n\nfrom calc import add, mul\n\n\nclass TestCalc(unittest.TestCase):\n"
                    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
                    "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n"
                ),
            },
            "test_files": {},
            "fail_to_pass": ["test_calc.TestCalc.test_add", "test_calc.TestCalc.test_mul"],
            "pass_to_pass": [],
        }
    )
    p, run_id = await reward_on(
        nats_server, pg_url, run_dir, [task], tmp_path / "suite.jsonl", reward={"function": function}
    )
    try:
        pool = EnvPoolClient(bus)
        ref = await pool.create("two-bugs")  # fix add only
        await pool.tools(
            ref, [c.ToolCall(id="1", name="edit_file", arguments={"path": "calc.py", "old": "a - b", "new": "a + b"})]
        )
        t = trajectory(run_id, ref, tid="g2-s0").model_copy(update={"task_id": "two-bugs"})
        await bus.publish(c.TRAJECTORY_FINISHED, t, msg_id=t.trajectory_id)
        (scored,) = await scored_messages(bus, 1)
        assert scored.reward == expected and not scored.passed
        assert scored.tests == {"test_calc.TestCalc.test_add": "passed", "test_calc.TestCalc.test_mul": "failed"}
    finally:
        await p.stop_all()


async def _consumer_idle(bus) -> bool:
    info = await bus.consumer_info(c.REWARD_WORKERS)
    return info.num_pending == 0 and info.num_ack_pending == 0


async def test_killed_reward_process_work_is_redelivered(nats_server, bus, pg_url, run_dir, tmp_path):
    # The code under test announces its test run (.scoring in the clean room) and waits for
    # the test's go (.go): the kill lands inside it, whatever the machine's speed.
    gate = "import os, time\nopen('.scoring', 'w').close()\nwhile not os.path.exists('.go'):\n    time.sleep(0.05)\n"
    gated = BASE.model_copy(update={"files": {**BASE.files, "calc.py": gate + BASE.files["calc.py"]}})
    (tmp_path / "gated.jsonl").write_text(json.dumps(gated.model_dump()) + "\n")
    exp = experiment(
        run_dir,
        nats_server.url,
        pg_url,
        tasks={"suite": str(tmp_path / "gated.jsonl")},
        nats={"ack_wait_s": {"reward-workers": 2.0}},
    )
    platform = InProcessPlatform(exp)
    run_id = platform.config("reward").run.id
    await add_run(pg_url, run_id)
    await platform.start("env-pool")
    try:
        pool = EnvPoolClient(bus)
        created = await bus.request(c.ENVPOOL_CREATE, c.SandboxCreate(task_id=BASE.id), c.SandboxCreated)
        root = Path((await pool.stats(created.sandbox.node_id)).workspace_root)
        await bus.publish(c.TRAJECTORY_FINISHED, trajectory(run_id, created.sandbox), msg_id="g1-s0")

        def rooms_scoring() -> set[Path]:
            return {p.parent for p in root.rglob(".scoring")}

        def reward_process(tag: str) -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-m", "kiln.reward.main", "--config", str(exp), "--instance", tag],
                stdout=open(run_dir / f"{tag}.log", "wb"),
                stderr=subprocess.STDOUT,
                env={**os.environ, "KILN_CONFIG": str(exp)},
            )

        first = reward_process("reward-a")
        try:

            async def taken():
                info = await bus.consumer_info(c.REWARD_WORKERS)
                return info.num_ack_pending == 1

            await wait_for(taken, 60, 0.1, "first reward process took the trajectory")
            await wait_for(rooms_scoring, 60, 0.05, "first reward process running the tests in its clean room")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        assert (await bus.js.stream_info("KILN_SCORED")).state.messages == 0
        first_rooms = rooms_scoring()
        for room in first_rooms:
            (room / ".go").touch()

        second = reward_process("reward-b")
        try:
            await wait_for(lambda: rooms_scoring() - first_rooms, 60, 0.05, "the successor running the tests")
            for room in rooms_scoring() - first_rooms:
                (room / ".go").touch()  # the successor's test run goes through
            (scored,) = await scored_messages(bus, 1, timeout=60)
        finally:
            second.send_signal(signal.SIGTERM)
            # Wait off the event loop: the in-process env-pool must keep answering meanwhile.
            await asyncio.to_thread(second.wait, 20)
        assert scored.trajectory.trajectory_id == "g1-s0"
        assert scored.infra_error is None and scored.reward == 0.0  # scored for real: the bug is unfixed
        assert scored.failure == c.Failure.TESTS_FAILED
        info = await bus.consumer_info(c.REWARD_WORKERS)
        assert info.delivered.consumer_seq == 2, "the trajectory should have been delivered exactly twice"
        assert info.num_ack_pending == 0
    finally:
        await platform.stop_all()


async def test_infra_errors_are_kiln_s_own_failures_only(nats_server, bus, pg_url, run_dir, tmp_path):
    """A task whose runner cannot work even on its pristine repository (its interpreter is
    not in the sandbox) is kiln's failure: infra_error, checked on a fresh pristine room.
    A task that makes touching its tests cost the reward scores a fix that edits them 0."""
    broken = BASE.model_copy(update={"id": "no-python", "test_command": "python9 -m unittest -v test_calc"})
    strict = BASE.model_copy(update={"id": "strict", "protected_touch": "fail"})
    p, run_id = await reward_on(nats_server, pg_url, run_dir, [broken, strict], tmp_path / "s.jsonl")
    try:
        fix_and_touch = FIX.model_copy(
            update={"changed": {**FIX.changed, "test_calc.py": BASE.test_files["test_calc.py"] + "# x\n"}}
        )
        cases = [
            trajectory(run_id, None, tid="g3-broken").model_copy(update={"task_id": "no-python", "final_diff": FIX}),
            trajectory(run_id, None, tid="g3-strict").model_copy(
                update={"task_id": "strict", "final_diff": fix_and_touch}
            ),
            trajectory(run_id, None, tid="g3-lenient").model_copy(update={"task_id": "strict", "final_diff": FIX}),
            # an external harness that hung: 0, whatever its workspace holds
            trajectory(run_id, None, tid="g3-hung").model_copy(
                update={"task_id": "strict", "final_diff": FIX, "finish_reason": "timeout", "harness_log": "stuck"}
            ),
        ]
        for t in cases:
            await bus.publish(c.TRAJECTORY_FINISHED, t, msg_id=t.trajectory_id)
        got = {s.trajectory.trajectory_id: s for s in await scored_messages(bus, len(cases), 120)}
    finally:
        await p.stop_all()
    assert got["g3-broken"].infra_error and "pristine repository" in got["g3-broken"].infra_error
    s = got["g3-strict"]
    assert s.reward == 0.0 and s.failure == c.Failure.PROTECTED and s.tests[BASE.fail_to_pass[0]] == c.CaseStatus.PASSED
    assert s.integrity.protected == {"test_calc.py": "test file test_calc.py"} and s.infra_error is None
    assert got["g3-lenient"].reward == 1.0 and got["g3-lenient"].passed
    hung = got["g3-hung"]
    assert (
        hung.reward == 0.0
        and hung.failure == c.Failure.HARNESS
        and "stuck" in hung.failure_detail
        and hung.infra_error is None
    )


async def test_reward_refuses_a_suite_it_cannot_score(nats_server, bus, pg_url, run_dir, tmp_path):
    t = BASE.model_copy(update={"test_command": "bash run_tests.sh"})
    (tmp_path / "s.jsonl").write_text(json.dumps(t.model_dump()) + "\n")
    p = InProcessPlatform(experiment(run_dir, nats_server.url, pg_url, tasks={"suite": str(tmp_path / "s.jsonl")}))
    with pytest.raises(Exception, match="cannot be scored.*fix-calc.*not `python -m unittest"):
        try:
            await p.start("reward")
        finally:
            await p.stop_all()  # re-raises the service's own error


async def test_records_store_any_text_nul_surrogates_and_deep_json(pg_url):
    """Whatever bytes a workspace puts in test output, failure messages, the report or
    the agent's observations, the row is written (cleaned where PostgreSQL refuses it),
    never refused: a refused row is a trajectory never scored."""
    from kiln.shared.db import Base
    from kiln.shared.db.types import MAX_JSON_DEPTH, NUL_MARK, TOO_DEEP, SafeJSON, SafeString, SafeText

    plain = [
        f"{t.name}.{col.name}"
        for t in Base.metadata.tables.values()
        for col in t.columns
        if not isinstance(col.type, (SafeString, SafeText, SafeJSON))
        and col.type.python_type is str
        or type(col.type).__name__ == "JSON"
    ]
    assert plain == [], f"string and JSON columns must clean what they store: {plain}"

    dirty = "a\0b \udcff c\x00"
    deep: object = "bottom"
    for _ in range(MAX_JSON_DEPTH + 10):
        deep = [deep]
    db = Database(pg_url)
    try:
        async with db.session() as s:
            s.add(Run(id="r-nul", name="t", detail=dirty))
        async with db.session() as s:
            s.add(
                TrajectoryRecord(
                    trajectory_id="t-nul",
                    run_id="r-nul",
                    group_id="g",
                    task_id="fix-calc",
                    sample_index=0,
                    dispatch_version=0,
                    test_output=dirty,
                    failure="tests_failed",
                    failure_detail=dirty,
                    integrity={"protected": {dirty: dirty}},
                    report={"errors": [[dirty, dirty]], "deep": deep},
                    messages=[{"role": "tool", "content": dirty}],
                    worker_id=dirty,
                )
            )
        async with db.session() as s:
            rec = await s.get(TrajectoryRecord, "t-nul")
            run = await s.get(Run, "r-nul")
    finally:
        await db.close()
    clean = f"a{NUL_MARK}b \ufffd c{NUL_MARK}"
    assert run.detail == rec.test_output == rec.failure_detail == rec.worker_id == clean
    assert rec.integrity == {"protected": {clean: clean}} and rec.messages[0]["content"] == clean
    assert rec.report["errors"] == [[clean, clean]]
    depth, node = 0, rec.report["deep"]
    while isinstance(node, list):
        node, depth = node[0], depth + 1
    assert node == TOO_DEEP and depth < MAX_JSON_DEPTH
