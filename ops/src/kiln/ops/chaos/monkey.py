"""``kiln chaos`` (and ``bench/chaos.py``): a local run with processes SIGKILLed in it.

It runs ``kiln run``'s own ``LocalPlatform`` in this process (so the children it kills
are the launcher's very ``Popen`` objects, not guesses from ``ps``), and a seeded plan
kills rollout, reward, env-pool, weights, the learner and nats-server at moments chosen
from the run's progress: kill ``i`` fires once the database holds ``at_i`` scored
training trajectories (``at_i`` drawn from the seed over the first 85% of the run), and
only after the previous victim's replacement is running, so every kill meets a platform
that is whole again. Optionally it publishes malformed messages on purpose (they must
end in the dead-letter stream, and nothing else may). When the run is over it checks
every invariant of ``kiln.ops.chaos.invariants`` from durable records and prints the
kills survived, the groups lost and the wall time against an unkilled baseline run of
the same configuration and seed.

Exit status: 0 when the run finished, every planned kill happened and was survived and
every invariant holds; 1 otherwise, with the reasons printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln.ops.chaos import invariants as inv

TARGETS = ("rollout", "reward", "env-pool", "weights", "learner", "nats")
"""What can be killed: a service (any replica of it) or the embedded nats-server."""


@dataclass
class Kill:
    target: str
    at: int
    """Fire once this many training trajectories are scored (the run's progress)."""
    label: str = ""
    """The process killed (``reward-0``, ``nats-server``)."""
    pid: int = 0
    t: float | None = None
    """Seconds into the run when it was killed (None: the run ended first)."""
    version: int | None = None
    """Policy versions trained when it was killed."""
    back_after: float | None = None
    """Seconds until its replacement was running (None: it never came back)."""


@dataclass
class Result:
    run_id: str
    run_dir: str
    exit_code: int
    wall_s: float
    kills: list[Kill]
    violations: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    baseline_s: float | None = None

    @property
    def survived(self) -> int:
        return sum(k.t is not None and k.back_after is not None for k in self.kills) if self.exit_code == 0 else 0

    @property
    def ok(self) -> bool:
        return not self.violations and self.survived == len(self.kills)


def plan(seed: int, n: int, targets: list[str], expected_trajectories: int) -> list[Kill]:
    """``n`` kills: every target once in a shuffled order before any is repeated, at
    progress points drawn uniformly over the first 85% of the run's trajectories."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < n:
        cycle = list(targets)
        rng.shuffle(cycle)
        order += cycle
    hi = max(2, int(expected_trajectories * 0.85))
    points = sorted(rng.randint(1, hi) for _ in range(n))
    return [Kill(t, at) for t, at in zip(order[:n], points)]


def _say(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _nats_procs(platform) -> list:
    """The embedded nats-server process(es): one server, or each node of a cluster."""
    nats = platform.nats
    servers = list(getattr(nats, "nodes", None) or ([nats] if nats is not None else []))
    return [s for s in servers if getattr(s, "proc", None) is not None]


class Monkey:
    """Kills the platform's processes as planned, watching progress in the database."""

    def __init__(self, platform, kills: list[Kill], seed: int, bad_input: int):
        self.platform = platform
        self.kills = kills
        self.rng = random.Random(f"{seed}:victims")
        self.bad_input = bad_input
        self.bad_at = (
            random.Random(f"{seed}:bad").randint(1, max(1, kills[-1].at if kills else 1)) if bad_input else None
        )
        self.injected: set[str] = set()
        self.envpool_pids: dict[str, set[int]] = {}
        """node id -> every env-pool pid seen (its workspaces and cgroups are named by it)."""
        self.t0 = time.monotonic()

    def _victims(self, target: str) -> list[tuple[str, object]]:
        """(label, handle) of the live processes of ``target``: a service's ``Child`` or a NatsServer."""
        if target == "nats":
            return [
                (getattr(s, "name", "") or "nats-server", s)
                for s in _nats_procs(self.platform)
                if s.proc.poll() is None
            ]
        return [
            (ch.name, ch)
            for ch in self.platform.children
            if ch.info.name == target and ch.restart_at is None and ch.proc.poll() is None
        ]

    def _note_envpool(self) -> None:
        for ch in self.platform.children:
            if ch.info.name == "env-pool" and ch.proc.poll() is None:
                self.envpool_pids.setdefault(ch.name, set()).add(ch.proc.pid)

    async def run(self, run_id: str) -> None:
        from sqlalchemy import func, select

        from kiln.shared.db import Database, StepRecord, TrajectoryRecord

        while not (self.platform.experiment.get("database", {}).get("url") and self.platform.children):
            await asyncio.sleep(0.2)  # the launcher is starting NATS, the database, the services
        db = Database(self.platform.experiment["database"]["url"])
        try:

            async def progress() -> tuple[int, int]:
                async with db.session() as s:
                    n = await s.scalar(
                        select(func.count())
                        .select_from(TrajectoryRecord)
                        .where(TrajectoryRecord.run_id == run_id, TrajectoryRecord.purpose == "train")
                    )
                    v = await s.scalar(select(func.count()).select_from(StepRecord).where(StepRecord.run_id == run_id))
                return n or 0, v or 0

            previous: tuple[Kill, object] | None = None
            pending = list(self.kills)
            while pending or self.bad_at is not None:
                self._note_envpool()
                if previous is not None and previous[0].back_after is None:
                    self._came_back(*previous)
                    await asyncio.sleep(0.1)
                    continue  # the next kill meets a whole platform
                scored, steps = await progress()
                if self.bad_at is not None and scored >= self.bad_at:
                    await self._inject(run_id)
                    self.bad_at = None
                if pending and scored >= pending[0].at:
                    handle = self._kill(pending[0], steps)
                    if handle is not None:
                        previous = (pending.pop(0), handle)
                        continue
                await asyncio.sleep(0.2)
            while previous is not None and previous[0].back_after is None:  # the last victim's return
                self._note_envpool()
                self._came_back(*previous)
                await asyncio.sleep(0.1)
            while True:  # env-pool restarts of the launcher's own (a crash) are still recorded
                self._note_envpool()
                await asyncio.sleep(0.2)
        finally:
            await db.close()

    def _kill(self, k: Kill, steps: int) -> object | None:
        victims = self._victims(k.target)
        if not victims:  # between a crash of its own and its restart: wait for the next one
            return None
        k.label, handle = self.rng.choice(sorted(victims, key=lambda v: v[0]))
        k.pid = handle.proc.pid
        os.kill(k.pid, signal.SIGKILL)
        k.t, k.version = time.monotonic() - self.t0, steps
        _say(
            f"killed {k.label} (pid {k.pid}, SIGKILL) at {k.at} scored trajectories, version {steps}, {k.t:.1f}s into the run"
        )
        return handle

    def _came_back(self, k: Kill, handle) -> None:
        proc = handle.proc
        if (
            proc is not None
            and proc.pid != k.pid
            and proc.poll() is None
            and getattr(handle, "restart_at", None) is None
        ):
            k.back_after = time.monotonic() - self.t0 - k.t
            _say(f"{k.label} is running again (pid {proc.pid}) {k.back_after:.1f}s after its kill")

    async def _inject(self, run_id: str) -> None:
        """Malformed messages on purpose, on the reward's and the learner's work subjects:
        each must be dead-lettered with its reason (and counted as deliberate)."""
        from kiln.shared import contracts as c
        from kiln.shared.bus import Bus
        from kiln.shared.config import NatsSettings

        settings = NatsSettings(url=self.platform.experiment["nats"]["url"])
        if self.platform.creds is not None:
            from kiln.shared.bus.auth import ADMIN

            settings.user, settings.password = ADMIN, self.platform.creds.users[ADMIN]
        bus = await Bus.connect(settings, "chaos")
        try:
            for i in range(self.bad_input):
                marker = f"{run_id}-bad{i}"
                subject = (c.TRAJECTORY_FINISHED, c.TRAJECTORY_SCORED)[i % 2]
                body = inv.BAD_INPUT_MARKER + f" {marker} {{not json".encode()
                await bus.js.publish(subject, body, headers={"Nats-Msg-Id": marker})
                self.injected.add(marker)
        finally:
            await bus.close()
        _say(f"published {self.bad_input} malformed messages on purpose (they must be dead-lettered)")


async def chaos_run(
    config: str | None,
    overrides: list[str],
    *,
    seed: int,
    kills: int,
    targets: list[str],
    bad_input: int = 0,
    label: str = "chaos",
) -> Result:
    """One run with ``kills`` kills (0: a baseline), then every invariant checked."""
    from kiln.ops.local_run import LocalPlatform

    run_id = f"{label}-s{seed}-{uuid.uuid4().hex[:6]}"
    overrides = ["local.dashboard=false", f"run.seed={seed}", *overrides, f"run.id={run_id}"]
    platform = LocalPlatform(config, overrides)
    a = platform.experiment.get("algorithm", {})
    from kiln.shared.config import AlgorithmSettings

    alg = AlgorithmSettings(**a)
    schedule = plan(seed, kills, targets, alg.steps * alg.groups_per_step * alg.samples_per_group)
    if schedule:
        _say(f"seed {seed}: kills planned at scored trajectories " + ", ".join(f"{k.target}@{k.at}" for k in schedule))
    monkey = Monkey(platform, schedule, seed, bad_input)
    t0 = time.monotonic()
    monkey.t0 = t0
    watcher = asyncio.create_task(monkey.run(run_id))
    try:
        code = await platform.run()
    finally:
        watcher.cancel()
        try:
            await watcher
        except asyncio.CancelledError:
            pass
    wall = time.monotonic() - t0
    res = Result(run_id, str(platform.run_dir), code, wall, schedule)
    if code != 0:
        res.violations.append(f"kiln run exited {code}: {platform.failed or ''}"[:2000])
    for k in schedule:
        if k.t is None:
            res.violations.append(
                f"the planned kill of {k.target} at {k.at} scored trajectories never happened (the run ended first)"
            )
        elif k.back_after is None:
            res.violations.append(f"{k.label} (killed at {k.t:.1f}s) never came back")
    await check(res, platform.run_dir, monkey.envpool_pids, monkey.injected)
    return res


async def check(res: Result, run_dir: Path, envpool_pids: dict[str, set[int]], injected: set[str]) -> None:
    """Every invariant from durable records, into ``res``: the host first (before this
    check starts a database server of its own on the run's data), then the database, the
    weights store and the run's JetStream store."""
    from kiln.ops.dashboard.serve import database_of_run

    report = inv.Report()
    incarnations = inv.envpool_incarnations(run_dir, envpool_pids)
    deadline = time.monotonic() + 30
    while True:  # processes the launcher stopped may still be exiting: wait for a clean host
        host = inv.check_host(run_dir, incarnations)
        if not host.violations or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    report.violations += host.violations
    report.facts.update(host.facts)
    url, pg = database_of_run(run_dir)
    try:
        await inv.check_records(url, res.run_id, report)
        groups = await inv.group_outcomes(url, res.run_id)
    finally:
        if pg is not None:
            pg.stop()
    await inv.check_bus(run_dir / "nats", groups, injected, report)
    res.violations += report.violations
    res.facts.update(report.facts)


def summary(res: Result) -> str:
    lines = [
        "",
        f"chaos run {res.run_id}: {res.run_dir}",
        "",
        "| # | target | process | at (scored trajectories) | version | killed at | back after |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, k in enumerate(res.kills, 1):
        t = f"{k.t:.1f} s" if k.t is not None else "never"
        back = f"{k.back_after:.1f} s" if k.back_after is not None else "-"
        lines.append(
            f"| {i} | {k.target} | {k.label or '-'} | {k.at} | {k.version if k.version is not None else '-'} | {t} | {back} |"
        )
    f = res.facts
    outcomes = ", ".join(f"{n} {o}" for o, n in sorted(f.get("group_outcomes", {}).items()))
    lines += [
        "",
        f"kills survived: {res.survived} of {len(res.kills)}",
        f"groups lost: {f.get('lost_groups', '?')} (dispatched {f.get('groups_dispatched', '?')}: {outcomes or 'none'})",
        f"steps recorded: {f.get('steps_recorded', '?')}, policy versions: {f.get('versions', '?')} "
        f"({f.get('versions_verified', '?')} verified by sha256), trajectories scored: {f.get('trajectories_scored', '?')}",
        f"dead letters: {f.get('dead_letters', '?')} ({f.get('deliberate_dead_letters', '?')} deliberate, of "
        f"{f.get('deliberate_messages', '?')} malformed messages published on purpose); "
        f"dropped-log: {f.get('dropped_log', '?')} groups ({f.get('drops_not_in_log', '?')} drops missing from it); "
        f"env-pool processes checked for leftovers: {f.get('envpool_incarnations', '?')}",
    ]
    extra = (
        f", baseline {res.baseline_s:.1f} s, extra {res.wall_s - res.baseline_s:+.1f} s"
        if res.baseline_s is not None
        else ""
    )
    lines.append(f"wall time: {res.wall_s:.1f} s{extra}")
    if res.violations:
        lines.append(f"INVARIANTS FAILED ({len(res.violations)}):")
        lines += [f"  - {v}" for v in res.violations[:50]]
    else:
        lines.append("invariants: all hold")
    return "\n".join(lines)


def parser(prog: str = "kiln chaos") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="a local run with processes SIGKILLed at random moments, then its invariants checked"
    )
    p.add_argument("--config", default="configs/smoke.toml", help="experiment TOML (default: configs/smoke.toml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument(
        "--seed", type=int, default=0, help="picks the kills (targets, moments, replicas) and the run's seed"
    )
    p.add_argument("--kills", type=int, default=6)
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--steps", type=int, help="algorithm.steps")
    p.add_argument("--root", help="run.root: where the run folders go")
    p.add_argument(
        "--bad-input", type=int, default=2, help="malformed messages published on purpose (must be dead-lettered)"
    )
    p.add_argument(
        "--baseline",
        action="store_true",
        help="first run the same configuration and seed without kills, for the extra wall time",
    )
    p.add_argument("--baseline-s", type=float, help="a baseline wall time measured before")
    p.add_argument("--json", help="write the result here as JSON")
    return p


async def amain(a: argparse.Namespace) -> int:
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    if bad := set(targets) - set(TARGETS):
        raise SystemExit(f"unknown targets {sorted(bad)}; choose from {', '.join(TARGETS)}")
    overrides = list(a.overrides)
    if a.steps is not None:
        overrides.append(f"algorithm.steps={a.steps}")
    if a.root:
        overrides.append(f"run.root='{Path(a.root).resolve()}'")
    baseline = a.baseline_s
    if a.baseline:
        _say("baseline: the same run without kills")
        base = await chaos_run(a.config, overrides, seed=a.seed, kills=0, targets=targets, label="baseline")
        if not base.ok:
            print(summary(base), flush=True)
            _say("the baseline run itself failed")
            return 1
        baseline = base.wall_s
        _say(f"baseline: {baseline:.1f} s")
    res = await chaos_run(a.config, overrides, seed=a.seed, kills=a.kills, targets=targets, bad_input=a.bad_input)
    res.baseline_s = baseline
    print(summary(res), flush=True)
    if a.json:
        Path(a.json).write_text(
            json.dumps({**asdict(res), "survived": res.survived, "ok": res.ok}, indent=1, default=str)
        )
    return 0 if res.ok else 1


def main(argv: list[str] | None = None, prog: str = "kiln chaos") -> int:
    return asyncio.run(amain(parser(prog).parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
