"""What the clean room costs: reward's time per trajectory, the old way and the new.

    .venv/bin/python bench/reward.py [--rounds 4] [--concurrency 4] [--tasks N]

Against a real nats-server and a real env-pool node (its own process, bwrap sandboxes,
the built-in suite), for every built-in task, two trajectories made with the agent's
tools (one unchanged, one with the task's solution written), each scored twice:

(a) in place, as reward scored before the clean room: the task's test files written over
    the trajectory's own sandbox, ``test_command`` run there, its printed output parsed
    (``kiln.shared.tasks.report``), then the sandbox destroyed;
(b) in a clean room (``kiln.reward.cleanroom``): a fresh sandbox of the task, the
    trajectory's diff and the test files written, kiln's runner run, its report read,
    the room destroyed in the background and the trajectory's sandbox destroyed meanwhile
    (as the reward service does).

(a) and (b) alternate trajectory by trajectory, so both see the same machine. Prints per
trajectory p50 and mean wall time, scorings per second ``--concurrency`` at a time, and
(b)/(a); both must agree on every trajectory's pass or fail.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from common import envpool_node

from kiln.reward.cleanroom import CleanRoom
from kiln.shared import contracts as c
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.tasks import Task, load_suite
from kiln.shared.tasks.report import outcome, parse_test_report


async def agent(pool: EnvPoolClient, task: Task, solve: bool) -> c.Trajectory:
    ref = await pool.create(task.id)
    if solve:
        calls = [
            c.ToolCall(id=f"w{i}", name="write_file", arguments={"path": p, "content": t})
            for i, (p, t) in enumerate(sorted(task.solution.items()))
        ]
        assert all(r.error is None for r in await pool.tools(ref, calls))
    diff = await pool.diff(ref)
    return c.Trajectory(
        run_id="bench",
        trajectory_id=f"{task.id}-{solve}-{time.monotonic_ns()}",
        group_id="g",
        task_id=task.id,
        sample_index=0,
        dispatch_version=0,
        status=c.TrajectoryStatus.FINISHED,
        token_ids=[1],
        logprobs=[0.0],
        token_versions=[-1],
        loss_mask=[0],
        sandbox=ref,
        final_diff=diff,
    )


async def in_place(pool: EnvPoolClient, traj: c.Trajectory, task: Task) -> bool:
    calls = [
        c.ToolCall(id=f"t{i}", name="write_file", arguments={"path": p, "content": t})
        for i, (p, t) in enumerate(sorted(task.test_files.items()))
    ]
    assert all(r.error is None for r in await pool.tools(traj.sandbox, calls))
    r = await pool.exec(traj.sandbox, task.test_command, task.timeout_s)
    tests = outcome(parse_test_report(r.stdout + "\n" + r.stderr), task.fail_to_pass + task.pass_to_pass)
    await pool.destroy(traj.sandbox)
    return all(s == c.CaseStatus.PASSED for s in tests.values())


async def clean_room(room: CleanRoom, pool: EnvPoolClient, traj: c.Trajectory, task: Task) -> bool:
    # as reward does: the agent's sandbox goes while the clean room runs (its diff is in hand)
    verdict, _ = await asyncio.gather(room.judge(traj, task), pool.destroy(traj.sandbox))
    return verdict.failure is None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main(rounds: int, concurrency: int, max_tasks: int | None) -> None:
    suite = load_suite("builtin")
    tasks = [t for t in suite.tasks if t.solution][:max_tasks]
    async with envpool_node("builtin", tasks[0].id, "reward", max_sandboxes=512) as (_bus, pool):
        room = CleanRoom(pool, 15.0, 32 << 20)
        old: list[float] = []
        new: list[float] = []
        for _ in range(rounds):
            for task in tasks:
                for solve in (False, True):
                    a, b = await agent(pool, task, solve), await agent(pool, task, solve)
                    t = time.perf_counter()
                    pa = await in_place(pool, a, task)
                    old.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    pb = await clean_room(room, pool, b, task)
                    new.append(time.perf_counter() - t)
                    assert pa == pb == solve, (task.id, solve, pa, pb)
        await room.close()

        async def throughput(score) -> float:
            trajs = [(await agent(pool, t, s), t) for t in tasks for s in (False, True)]
            todo = list(trajs)
            t0 = time.perf_counter()

            async def worker():
                while todo:
                    traj, task = todo.pop()
                    await score(traj, task)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return len(trajs) / (time.perf_counter() - t0)

        rate_old = await throughput(lambda tr, t: in_place(pool, tr, t))
        rate_new = await throughput(lambda tr, t: clean_room(room, pool, tr, t))
        await room.close()
    n = len(old)
    print(
        f"| scoring ({n} trajectories, {len(tasks)} built-in tasks) | p50 ms | mean ms | per second, {concurrency} at a time |"
    )
    print("|---|---|---|---|")
    print(
        f"| (a) in place, printed output parsed | {pct(old, 0.5) * 1e3:.1f} | {statistics.mean(old) * 1e3:.1f} | {rate_old:.1f} |"
    )
    print(
        f"| (b) clean room, kiln's runner | {pct(new, 0.5) * 1e3:.1f} | {statistics.mean(new) * 1e3:.1f} | {rate_new:.1f} |"
    )
    print(
        f"\n(b)/(a): p50 {pct(new, 0.5) / pct(old, 0.5):.2f}, mean {statistics.mean(new) / statistics.mean(old):.2f}, "
        f"throughput {rate_old / rate_new:.2f}"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4, help="passes over the built-in suite")
    ap.add_argument("--concurrency", type=int, default=4, help="scorings at once for the throughput figure")
    ap.add_argument("--tasks", type=int, default=None, help="only the first N built-in tasks")
    a = ap.parse_args()
    asyncio.run(main(a.rounds, a.concurrency, a.tasks))
