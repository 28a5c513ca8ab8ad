"""Run real kiln services as asyncio tasks in the test process, over a real nats-server
and a real database: the same ``serve`` functions the service processes run, with
each service keeping its own tracer provider so a test can collect every span."""

from __future__ import annotations

import asyncio
import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path

from kiln.shared.config import deep_merge, load_config, render_toml
from kiln.shared.registry import discover
from kiln.shared.service import run_service


def experiment(run_dir: Path, nats_url: str, db_url: str, **sections) -> Path:
    """A small, fast experiment file in ``run_dir``; ``sections`` override tables."""
    base = {
        "run": {
            "id": f"test-{run_dir.parent.name[-12:]}".replace(".", "-").replace("_", "-"),
            "dir": str(run_dir),
            "seed": 0,
        },
        "nats": {"url": nats_url, "ack_wait_s": {}},
        "database": {"url": db_url},
        "telemetry": {"log_format": "text"},
        "model": {
            "vocab_size": 1024,
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
        "algorithm": {
            "steps": 3,
            "groups_per_step": 2,
            "samples_per_group": 2,
            "max_staleness": 0,
            "group_deadline_s": 120,
        },
        "rollout": {"max_turns": 2, "max_new_tokens": 16, "max_total_tokens": 2048},
        "learner": {"deadline_check_s": 0.5, "tokenizer_corpus_repeats": 1},
        "envpool": {"reap_interval_s": 0.5, "semantic_mode": "bm25"},  # the embedding model loads in its own tests
    }
    path = run_dir / "experiment.toml"
    path.write_text(render_toml(deep_merge(base, sections)))
    return path


def write_suite(folder: Path, tasks: list, environments: list[dict]) -> Path:
    """A TOML task suite in ``folder``: ``tasks.jsonl`` and the environments it declares."""
    from kiln.shared.environments import EnvironmentSpec
    from kiln.shared.tasks import write_suite as write

    return write(tasks, [EnvironmentSpec.model_validate(e) for e in environments], folder)


async def score_unchanged_and_solved(nats_server, bus, db_url: str, run_dir: Path, suite: Path, env_root: Path):
    """Every task of ``suite`` that has a solution, scored by a real env-pool and reward:
    once unchanged, once with its solution written by the agent's ``write_file`` tool.
    Returns ({trajectory id: (reward, infra_error)}, what a sound reward gives: 0 and 1)."""
    from test_reward import scored_messages, trajectory

    from kiln.shared import contracts as c
    from kiln.shared.envpool_client import EnvPoolClient
    from kiln.shared.tasks import load_suite

    envpool = {"backend": "bwrap", "warm_per_task": 0, "environments": {"root": str(env_root)}}
    p, run_id = await reward_platform(run_dir, nats_server.url, db_url, suite, envpool=envpool)
    try:
        pool = EnvPoolClient(bus)
        want = {}
        for t in [t for t in load_suite(str(suite)).tasks if t.solution]:
            unchanged = await pool.create(t.id)
            solved = await pool.create(t.id)
            calls = [
                c.ToolCall(id=str(i), name="write_file", arguments={"path": f, "content": text})
                for i, (f, text) in enumerate(sorted(t.solution.items()))
            ]
            assert all(r.error is None for r in await pool.tools(solved, calls))
            for kind, ref in (("unchanged", unchanged), ("solved", solved)):
                tr = trajectory(run_id, ref, tid=f"{t.id}-{kind}").model_copy(update={"task_id": t.id})
                want[tr.trajectory_id] = (1.0 if kind == "solved" else 0.0, None)
                await bus.publish(c.TRAJECTORY_FINISHED, tr, msg_id=tr.trajectory_id)
        assert want, f"no task of {suite} has a solution"
        scored = await scored_messages(bus, len(want), timeout=120 + 60 * len(want))
        return {s.trajectory.trajectory_id: (s.reward, s.infra_error) for s in scored}, want
    finally:
        await p.stop_all()


async def reward_platform(
    run_dir: Path, nats_url: str, db_url: str, suite, **sections
) -> tuple[InProcessPlatform, str]:
    """env-pool and reward (in-process) over ``suite``, with the run's row in the
    database; (platform, run id)."""
    from kiln.shared.db import Database, Run

    p = InProcessPlatform(experiment(run_dir, nats_url, db_url, tasks={"suite": str(suite)}, **sections))
    run_id = p.config("reward").run.id
    db = Database(db_url)
    async with db.session() as s:
        s.add(Run(id=run_id, name="t"))
    await db.close()
    await p.start("env-pool")
    await p.start("reward")
    return p, run_id


@dataclass
class Running:
    name: str
    instance: str
    stop: asyncio.Event
    task: asyncio.Task


class InProcessPlatform:
    def __init__(self, experiment_file: Path, exporter=None):
        self.experiment_file = experiment_file
        self.exporters = (exporter,) if exporter is not None else ()
        self.services = discover()
        self.running: list[Running] = []

    def config(self, name: str):
        return load_config(self.services[name].config_class(), self.experiment_file)

    async def start(self, name: str, instance: str | None = None, wait_ready: bool = True, **sections: dict) -> Running:
        """``sections``: per-section overrides of this instance's config (e.g. ``rollout={"role": "eval"}``)."""
        info = self.services[name]
        cfg = self.config(name)
        for section, values in sections.items():
            cfg = cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=values)})
        serve = importlib.import_module(info.module).serve
        stop = asyncio.Event()
        ready = asyncio.Event()
        instance = instance or f"{name}-{len([r for r in self.running if r.name == name])}"
        task = asyncio.create_task(
            run_service(
                name,
                cfg,
                serve,
                instance=instance,
                stop=stop,
                install_signals=False,
                set_global_telemetry=False,
                extra_exporters=self.exporters,
                ready=ready,
            ),
            name=instance,
        )
        r = Running(name, instance, stop, task)
        self.running.append(r)
        if wait_ready:
            waiter = asyncio.create_task(ready.wait())
            await asyncio.wait({waiter, task}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if task.done():
                task.result()  # raises the service's start-up error
            if not ready.is_set():
                raise TimeoutError(f"{instance} did not become ready within 60s")
        return r

    async def start_all(self, replicas: dict[str, int] | None = None) -> None:
        for name in self.services:
            for _ in range((replicas or {}).get(name, 1)):
                # The learner publishes version 0 while starting; the others must be up first.
                await self.start(name, wait_ready=name != "learner")

    def failed(self) -> list[tuple[str, BaseException]]:
        return [
            (r.instance, r.task.exception())
            for r in self.running
            if r.task.done() and not r.task.cancelled() and r.task.exception()
        ]

    async def stop(self, r: Running, timeout: float = 20.0) -> None:
        r.stop.set()
        await asyncio.wait_for(r.task, timeout)
        self.running.remove(r)

    async def stop_all(self) -> None:
        """Stop in reverse start order (as ``kiln run`` does), raising the first error seen."""
        errors = []
        for r in sorted(self.running, key=lambda r: -self.services[r.name].order):
            r.stop.set()
            try:
                await asyncio.wait_for(r.task, 30)
            except BaseException as e:  # keep stopping the others
                errors.append(e)
        self.running.clear()
        if errors:
            raise errors[0]


async def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > end:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(interval)


async def request_once_served(bus, subject: str, msg, reply_type, timeout: float = 20.0):
    """``bus.request`` to a responder another connection has just subscribed and flushed.
    Under load the full suite has met ``no_responders`` on such a first request (twice on
    2026-12-07/08, cause not found: the subscription was flushed before): the test waits
    for the state it needs (a responder that answers), any other error still fails."""
    from kiln.shared.bus import RemoteError

    async def answered():
        try:
            return await bus.request(subject, msg, reply_type)
        except RemoteError as e:
            if e.code != "no_responders":
                raise
            return None

    return await wait_for(answered, timeout, 0.1, f"an answer on {subject}")


async def wait_run_ended(platform: InProcessPlatform, db, run_id: str, timeout: float) -> None:
    """Until the run's row leaves ``running``, failing at once if a service has crashed."""
    from kiln.shared.db import Run

    async def ended():
        assert not platform.failed(), platform.failed()
        async with db.session() as s:
            run = await s.get(Run, run_id)
        return run is not None and run.status != "running"

    await wait_for(ended, timeout, 0.5, "run ended")
