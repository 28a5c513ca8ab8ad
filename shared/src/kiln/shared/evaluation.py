"""Held-out evaluation of a policy version: the requests, the collector, the numbers.

An evaluation of version ``v`` is, per task of the held-out split, one greedy episode
and ``samples`` sampled ones (``EvalRequest`` on ``kiln.eval.work``). Eval workers
(rollout replicas with ``rollout.role = eval``) run them under exactly ``v``, reward
scores them like any trajectory and sends the scores to ``kiln.eval.scored``, which
every ``EvalCollector`` watches (fan-out, so the controller of a run and a ``kiln
eval`` on the same bus never take each other's scores); the collector that started
an evaluation writes its one ``evaluations`` row.

Invariants: an evaluation is recorded once (its row is written when the last expected
trajectory arrives, or at its timeout with what came back, the missing ones counted as
``missing``; one with nothing back at all is not recorded, since a row of zeros would
read as a policy that solves nothing); an infrastructure failure is reported as such
(``infra`` per task) and counts as not passed, so a broken sandbox can never raise a pass rate; scores of an
unknown evaluation (another collector's, or one already recorded) are ignored; a
collector that restarts loses the evaluations it had in flight (start them again).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from kiln.shared import contracts as c
from kiln.shared.bus import Bus
from kiln.shared.config import EvalSettings
from kiln.shared.db import Database, EvalRecord
from kiln.shared.tasks import Task, TaskSuite

log = logging.getLogger("kiln.evaluation")


def pass_at_k(n: int, passed: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``passed`` passed (Chen et al., 2021)."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - passed < k:
        return 1.0
    return 1.0 - math.comb(n - passed, k) / math.comb(n, k)


def eval_tasks(suite: TaskSuite, settings: EvalSettings) -> list[Task]:
    tasks = sorted(suite.split(settings.split), key=lambda t: t.id)
    return tasks[: settings.max_tasks] if settings.max_tasks else tasks


def eval_requests(
    run_id: str, eval_id: str, weights: c.WeightsPublished, tasks: list[Task], s: EvalSettings
) -> list[c.EvalRequest]:
    deadline = time.time() + s.timeout_s
    out = []
    for t in tasks:
        common = dict(run_id=run_id, eval_id=eval_id, weights=weights, task_id=t.id, seed=s.seed, deadline=deadline)
        out.append(c.EvalRequest(mode="greedy", n_samples=1, temperature=0.0, **common))
        if s.samples:
            out.append(c.EvalRequest(mode="sampled", n_samples=s.samples, temperature=s.temperature, **common))
    return out


def trajectory_id(eval_id: str, task_id: str, mode: str, index: int) -> str:
    return f"{eval_id}-{task_id}-{mode}-s{index}"


@dataclass
class _Pending:
    run_id: str
    version: int
    tasks: list[str]
    settings: EvalSettings
    suite: str
    started: float = field(default_factory=time.monotonic)
    greedy: dict[str, bool] = field(default_factory=dict)
    sampled: dict[str, list[bool]] = field(default_factory=dict)
    infra: dict[str, int] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    record: EvalRecord | None = None

    @property
    def expected(self) -> int:
        return len(self.tasks) * (1 + self.settings.samples)

    @property
    def received(self) -> int:
        return len(self.greedy) + sum(len(v) for v in self.sampled.values())


class EvalCollector:
    """Dispatches evaluations and records them: ``watch`` subscribes to the scores (call
    it before ``start``), ``start`` publishes one evaluation's requests, ``wait``
    returns its row once recorded."""

    def __init__(self, bus: Bus, db: Database, suite: TaskSuite):
        self.bus, self.db, self.suite = bus, db, suite
        self.pending: dict[str, _Pending] = {}

    async def watch(self) -> None:
        await self.bus.watch(c.EVAL_SCORED, c.ScoredTrajectory, self.on_scored, deliver="new")

    async def start(
        self, run_id: str, eval_id: str, weights: c.WeightsPublished, settings: EvalSettings, suite_name: str
    ) -> None:
        tasks = eval_tasks(self.suite, settings)
        if settings.samples and any(k > settings.samples for k in settings.k):
            raise ValueError(f"eval.k {settings.k} asks for more than eval.samples = {settings.samples}")
        self.pending[eval_id] = _Pending(run_id, weights.version, [t.id for t in tasks], settings, suite_name)
        for req in eval_requests(run_id, eval_id, weights, tasks, settings):
            await self.bus.publish(c.EVAL_WORK, req, msg_id=f"{eval_id}-{req.task_id}-{req.mode}")
        log.info("evaluating version %d on %d %s tasks (%s)", weights.version, len(tasks), settings.split, eval_id)

    async def on_scored(self, s: c.ScoredTrajectory) -> None:
        t = s.trajectory
        p = self.pending.get(t.eval_id)
        if p is None or p.done.is_set():
            return
        ok = s.passed and not s.infra_error
        if s.infra_error:
            p.infra[t.task_id] = p.infra.get(t.task_id, 0) + 1
        if t.trajectory_id == trajectory_id(t.eval_id, t.task_id, "greedy", 0):
            p.greedy[t.task_id] = ok
        else:
            p.sampled.setdefault(t.task_id, []).append(ok)
        if p.received >= p.expected:
            await self._record(t.eval_id, p)

    async def expire(self) -> None:
        """Record evaluations past their timeout with what came back."""
        for eval_id, p in list(self.pending.items()):
            if not p.done.is_set() and time.monotonic() - p.started > p.settings.timeout_s:
                log.warning("evaluation %s timed out with %d of %d episodes", eval_id, p.received, p.expected)
                await self._record(eval_id, p)

    async def _record(self, eval_id: str, p: _Pending) -> None:
        s = p.settings
        if p.received == 0:
            # Nothing came back (no eval worker is running?): a row of zeros would read as
            # a policy that solves nothing.
            log.error(
                "evaluation %s of version %d got no episode back within %.0fs; nothing recorded",
                eval_id,
                p.version,
                s.timeout_s,
            )
            p.done.set()
            return
        per_task = {}
        for tid in p.tasks:
            draws = p.sampled.get(tid, [])
            per_task[tid] = {
                "greedy": p.greedy.get(tid),
                "passed": sum(draws),
                "samples": len(draws),
                "infra": p.infra.get(tid, 0),
                "missing": (tid not in p.greedy) + s.samples - len(draws),
            }
        greedy = sum(bool(p.greedy.get(t)) for t in p.tasks) / len(p.tasks)
        pass_k = {}
        for k in s.k if s.samples else []:
            # A task with draws missing (timeout) is scored on what it has, or 0 without k of them.
            vals = [
                pass_at_k(len(d), sum(d), k) if len(d) >= k else 0.0 for d in (p.sampled.get(t, []) for t in p.tasks)
            ]
            pass_k[str(k)] = sum(vals) / len(vals)
        rec = EvalRecord(
            run_id=p.run_id,
            version=p.version,
            suite=p.suite,
            split=s.split,
            tasks=len(p.tasks),
            samples=s.samples,
            seed=s.seed,
            greedy_pass_rate=greedy,
            pass_at_k=pass_k,
            per_task=per_task,
            seconds=time.monotonic() - p.started,
        )
        async with self.db.session() as session:
            session.add(rec)
        p.record = rec
        p.done.set()
        log.info(
            "version %d: greedy pass %.0f%%%s",
            p.version,
            100 * greedy,
            "".join(f", pass@{k} {v:.0%}" for k, v in pass_k.items()),
        )

    async def wait(self, eval_id: str, timeout: float | None = None) -> EvalRecord | None:
        """The evaluation's row once recorded (None: nothing came back before its timeout)."""
        p = self.pending[eval_id]
        await asyncio.wait_for(p.done.wait(), timeout)
        return p.record

    def outstanding(self) -> list[str]:
        return [e for e, p in self.pending.items() if not p.done.is_set()]
