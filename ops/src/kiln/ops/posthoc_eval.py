"""``kiln eval RUN_DIR``: evaluate stored policy versions of a run, after the fact.

It brings up what an evaluation needs and nothing more, as local processes on a fresh
embedded nats-server: env-pool (sandboxes), reward (runs the tests) and one eval
worker (rollout with ``role = eval``); reopens the run's database (restarting its
embedded PostgreSQL when that is where the run wrote); reads each version's manifest
from the run's weights store, so the worker verifies every shard before it serves;
records one ``evaluations`` row per version (shown on the run's dashboard) and prints
the table. Everything it started is stopped when it returns, also on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

from pydantic import Field
from sqlalchemy import select

from kiln.shared import contracts as c
from kiln.shared.bus import Bus, RemoteError
from kiln.shared.config import (
    EvalSettings,
    NatsSettings,
    ServiceConfig,
    TaskSettings,
    deep_merge,
    load_config,
    load_toml,
    parse_overrides,
    render_toml,
)
from kiln.shared.db import Database, PolicyVersion
from kiln.shared.evaluation import EvalCollector
from kiln.shared.registry import discover
from kiln.shared.tasks import load_suite
from kiln.shared.weights.manifest import MANIFEST

SERVICES = (("env-pool", []), ("reward", []), ("rollout", ["--set", "rollout.role=eval"]))


def _say(msg: str) -> None:
    print(f"[kiln eval {time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def _weights(db: Database, run_id: str, versions: list[int] | None) -> list[c.WeightsPublished]:
    async with db.session() as s:
        q = (
            select(PolicyVersion)
            .where(PolicyVersion.run_id == run_id, PolicyVersion.deleted_at.is_(None))
            .order_by(PolicyVersion.version)
        )
        rows = (await s.scalars(q)).all()
    have = {r.version: r for r in rows}
    if versions is None:
        versions = sorted(have)
    missing = [v for v in versions if v not in have]
    if missing:
        raise SystemExit(f"kiln eval: run {run_id} has no stored version {missing} (stored: {sorted(have)})")
    out = []
    for v in versions:
        r = have[v]
        manifest = c.WeightsManifest.model_validate_json((Path(r.path) / MANIFEST).read_text())
        out.append(
            c.WeightsPublished(
                run_id=run_id, version=v, step=r.step, path=r.path, manifest=manifest, manifest_sha256=r.manifest_sha256
            )
        )
    return out


async def _wait_ready(bus: Bus, children: list, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    for name, proc, log in children:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}; see {log}")
            try:
                h = await bus.request(f"{c.HEALTH_PREFIX}.{name}", c.HealthProbe(), c.HealthReply, timeout=2.0)
                if h.detail.get("ready"):
                    break
            except (TimeoutError, RemoteError):
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"{name} did not become ready within {timeout:.0f}s; see {log}")
            await asyncio.sleep(0.5)


def _stop(children: list, grace: float = 15.0) -> None:
    for _, proc, _ in reversed(children):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    for _, proc, _ in children:
        try:
            proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_eval(run_dir: str, versions: list[int] | None, overrides: list[str]) -> int:
    from kiln.ops.dashboard.serve import database_of_run
    from kiln.ops.embedded import NatsServer

    run_dir_p = Path(run_dir).resolve()
    db_url, pg = database_of_run(run_dir_p)
    exp = deep_merge(load_toml(run_dir_p / "config.toml"), parse_overrides(overrides))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = run_dir_p / "eval" / stamp
    (work / "logs").mkdir(parents=True, exist_ok=True)
    nats = NatsServer(work / "nats", log_file=str(work / "logs" / "nats-server.log")).start()
    children: list = []
    try:
        exp = deep_merge(
            exp,
            {
                "nats": {"url": nats.url},
                "database": {"url": db_url},
                "telemetry": {
                    "traces_file": str(run_dir_p / "traces" / f"eval-{stamp}-{{service}}.jsonl"),
                    "metrics": {"port": -1},
                },
            },
        )
        cfg_file = work / "config.toml"
        cfg_file.write_text(render_toml(exp))
        settings = load_config(_EvalConfig, cfg_file)
        services = discover()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "KILN_CONFIG": str(cfg_file)}
        for name, extra in SERVICES:
            info = services[name]
            log = work / "logs" / f"{name}.log"
            argv = [
                *info.argv(load_config(info.config_class(), cfg_file)),
                "--config",
                str(cfg_file),
                "--instance",
                f"eval-{name}",
                *extra,
            ]
            proc = subprocess.Popen(
                argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            children.append((name, proc, log))
        _say(f"env-pool, reward and an eval worker on {nats.url} (logs in {work / 'logs'})")
        return asyncio.run(_evaluate(settings, db_url, versions, children))
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    finally:
        _stop(children)
        nats.stop()
        if pg:
            pg.stop()


class _EvalConfig(ServiceConfig):
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    """The run's task suite."""
    eval: EvalSettings = Field(default_factory=EvalSettings)
    """The evaluation's settings."""


async def _evaluate(cfg: _EvalConfig, db_url: str, versions: list[int] | None, children: list) -> int:
    run_id = cfg.run.id
    db = Database(db_url)
    bus = await Bus.connect(NatsSettings(url=cfg.nats.url), "kiln-eval")
    try:
        await bus.ensure_topology()
        await _wait_ready(bus, children)
        suite_name = cfg.tasks.suite
        collector = EvalCollector(bus, db, load_suite(suite_name))
        await collector.watch()
        results = []
        for w in await _weights(db, run_id, versions):
            eval_id = f"{run_id}-eval-{time.strftime('%Y%m%d%H%M%S')}-v{w.version}"
            await collector.start(run_id, eval_id, w, cfg.eval, suite_name)
            while True:
                try:
                    rec = await collector.wait(eval_id, 1.0)
                    break
                except TimeoutError:
                    await collector.expire()
            if rec is None:
                _say(
                    f"version {w.version}: no episode came back within eval.timeout_s; see the logs in {Path(cfg.run.dir)}"
                )
                return 1
            results.append(rec)
            ks = "".join(f", pass@{k} {v:.0%}" for k, v in rec.pass_at_k.items())
            _say(
                f"version {rec.version}: greedy pass {rec.greedy_pass_rate:.0%}{ks} ({rec.tasks} {rec.split} tasks, {rec.seconds:.0f}s)"
            )
        print(f"\n| version | greedy | {' | '.join(f'pass@{k}' for k in (results[0].pass_at_k if results else {}))} |")
        for rec in results:
            print(
                f"| {rec.version} | {rec.greedy_pass_rate:.0%} | {' | '.join(f'{v:.0%}' for v in rec.pass_at_k.values())} |"
            )
        return 0
    finally:
        await bus.close()
        await db.close()
