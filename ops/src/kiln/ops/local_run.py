"""``kiln run``: the whole platform as local processes, on embedded defaults.

It creates a run folder, starts an embedded nats-server and database, migrates the
database, writes the resolved experiment file every service reads, starts every
installed service (``kiln.services`` entry points) as its own process with its log
in ``<run>/logs/``, prints progress per policy version, and stops everything (services
first, in reverse start order, then NATS and the database) when the run finishes, fails,
the timeout passes, or on Ctrl-C. Exit code: 0 finished, 1 failed, 130 interrupted.

It supervises as compose or Kubernetes would: a service process that dies is restarted
with exponential backoff (``local.restart_backoff_s`` doubling up to
``local.restart_backoff_max_s``), and the run fails only when one crash-loops (more than
``local.max_restarts`` exits within ``local.restart_window_s``), with the reason and the
tail of its log; the embedded nats-server (or each node of the embedded cluster,
``nats.cluster_size``) is restarted at once on its port and store (clients reconnect,
JetStream's state is on disk; a cluster keeps serving while one node is away). A restarted learner resumes from its
whole-state checkpoint; the other services are stateless (their work is redelivered).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from kiln.shared import contracts as c
from kiln.shared.bus import Bus
from kiln.shared.config import (
    AlgorithmSettings,
    DatabaseSettings,
    EvalSettings,
    LocalSettings,
    ServiceConfig,
    deep_merge,
    load_config,
    load_toml,
    parse_overrides,
    render_toml,
)
from kiln.shared.registry import ServiceInfo, discover


class LocalRunConfig(ServiceConfig):
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    """Embedded database choice, or the URL of an existing one."""
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    """Read for the progress display (steps of the run)."""
    local: LocalSettings = Field(default_factory=LocalSettings)
    """Local process settings."""
    eval: EvalSettings = Field(default_factory=EvalSettings)
    """With ``eval.every`` set, an eval worker (rollout, ``role = eval``) runs beside the services."""


@dataclass
class ServiceProcess:
    name: str
    info: ServiceInfo
    proc: subprocess.Popen
    log: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: list[float] = field(default_factory=list)
    """When it was restarted (monotonic), for the crash-loop window."""
    restart_at: float | None = None
    """When the pending restart is due (its backoff), None when it runs."""


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # Ctrl-C reaches the launcher only; it stops children in order
    )


def _say(msg: str) -> None:
    print(f"[kiln {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def resolve_experiment(config_path: str | None, overrides: list[str]) -> dict:
    data = load_toml(Path(config_path)) if config_path else {}
    return deep_merge(data, parse_overrides(overrides))


class LocalPlatform:
    def __init__(self, config_path: str | None, overrides: list[str]):
        self.experiment = resolve_experiment(config_path, overrides)
        self.services = discover()
        if not self.services:
            raise RuntimeError("no kiln services are installed (pip install -e services/*)")
        self.children: list[ServiceProcess] = []
        self.nats = None
        self.pg = None
        self.finished = asyncio.Event()
        self.failed: str | None = None
        self.steps: list[c.StepMetrics] = []
        self.restarts = 0
        """Service restarts during the run (printed in the summary)."""
        self.creds = None
        """The bus's credentials (``kiln.shared.bus.auth``), when it is authenticated."""

    def _prepare(self) -> tuple[Path, LocalRunConfig]:
        exp = self.experiment
        run = exp.setdefault("run", {})
        run_id = run.get("id") or f"run-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
        run["id"] = run_id
        root = Path(run.get("root", "runs")).resolve()
        run_dir = Path(run.get("dir") or root / run_id).resolve()
        run["dir"] = str(run_dir)
        for sub in ("logs", "traces", "nats", "db"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        tel = exp.setdefault("telemetry", {})
        tel.setdefault("traces_file", str(run_dir / "traces" / "{service}.jsonl"))
        self.run_dir = run_dir
        self.config_file = run_dir / "config.toml"
        self.config_file.write_text(render_toml(exp))
        return run_dir, load_config(LocalRunConfig, self.config_file)

    def _start_infra(self, cfg: LocalRunConfig) -> None:
        from kiln.ops.embedded import NatsCluster, NatsServer, PostgresServer, postgres_bindir
        from kiln.shared.db import upgrade

        if cfg.local.embedded_nats:
            conf = None
            if cfg.local.authenticated_bus:
                from kiln.shared.bus.auth import Credentials, server_config

                self.creds = Credentials.generate(list(self.services))
                conf = self.run_dir / "nats" / "auth.conf"
                conf.parent.mkdir(parents=True, exist_ok=True)
                conf.write_text(server_config(self.creds))
                conf.chmod(0o600)
            size = cfg.nats.cluster_size
            if size > 1:
                self.nats = NatsCluster(
                    self.run_dir / "nats", size, log_dir=self.run_dir / "logs", config_file=conf
                ).start()
                what = f"a {size}-node NATS cluster with JetStream ({cfg.nats.stream_replicas} replicas per stream)"
            else:
                self.nats = NatsServer(
                    self.run_dir / "nats", log_file=str(self.run_dir / "logs" / "nats-server.log"), config_file=conf
                ).start()
                what = "nats-server with JetStream"
            self.experiment.setdefault("nats", {})["url"] = self.nats.url
            _say(f"{what} on {self.nats.url}" + (", a credential per service" if conf else ""))
        db = self.experiment.setdefault("database", {})
        if not db.get("url"):
            if cfg.database.embedded == "postgres" and postgres_bindir() is not None:
                self.pg = PostgresServer(self.run_dir / "db" / "pg").start()
                db["url"] = self.pg.url
                _say(f"PostgreSQL (embedded) on {self.pg.url}")
            else:
                if cfg.database.embedded == "postgres":
                    _say("PostgreSQL server binaries not found; using SQLite instead")
                db["url"] = f"sqlite:///{self.run_dir / 'db' / 'kiln.db'}"
                _say(f"SQLite database {db['url']}")
        upgrade(db["url"])
        self.config_file.write_text(render_toml(self.experiment))

    def _spawn(self, cfg: LocalRunConfig) -> None:
        for info in self.services.values():
            load_config(info.config_class(), self.config_file)  # fail before starting anything
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "KILN_CONFIG": str(self.config_file)}
        plan = [
            (name, info, f"{name}-{i}", [])
            for name, info in self.services.items()
            for i in range(cfg.local.replicas.get(name, 1))
        ]
        if cfg.eval.every > 0 and "rollout" in self.services:
            plan.append(("rollout", self.services["rollout"], "rollout-eval-0", ["--set", "rollout.role=eval"]))
        for name, info, label, extra in plan:
            log = self.run_dir / "logs" / f"{label}.log"
            if self.creds is not None:  # its own credential, in its environment only
                env = {**env, "KILN_NATS__USER": name, "KILN_NATS__PASSWORD": self.creds.users[name]}
            argv = [
                *info.argv(load_config(info.config_class(), self.config_file)),
                "--config",
                str(self.config_file),
                "--instance",
                label,
                *extra,
            ]
            self.children.append(ServiceProcess(label, info, spawn(argv, env, log), log, argv, env))
        _say("services: " + ", ".join(ch.name for ch in self.children) + f" (logs in {self.run_dir / 'logs'})")

    async def _watch(self, bus: Bus, run_id: str, steps: int) -> None:
        t0 = time.monotonic()

        async def on_weights(m: c.WeightsPublished) -> None:
            if m.version == 0:
                _say(
                    f"policy version 0 published ({sum(f.size for f in m.manifest.files) / 1e6:.1f} MB); rollouts start"
                )

        async def on_metrics(m: c.StepMetrics) -> None:
            if m.run_id != run_id:
                return
            self.steps.append(m)
            rate = sum(s.trajectories for s in self.steps) / max(1e-9, time.monotonic() - t0)
            _say(
                f"version {m.version}/{steps}: {m.trajectories} trajectories, reward {m.mean_reward:.3f}, "
                f"pass {m.pass_rate:.0%}, loss {m.loss:+.4f}, clip {m.clip_frac:.1%}, staleness {m.mean_staleness:.1f} (max {m.max_staleness}), "
                f"dropped {m.dropped_groups}, infra {m.infra_errors}, step {m.step_seconds:.1f}s, "
                f"learner waited {m.wait_seconds:.1f}s, {rate:.2f} traj/s"
            )

        async def on_event(m: c.RunEvent) -> None:
            if m.run_id != run_id:
                return
            if m.kind == "finished":
                self.finished.set()
            elif m.kind == "failed":
                self.failed = m.detail or "the run failed"
                self.finished.set()

        await bus.watch(c.weights_published_subject(run_id), c.WeightsPublished, on_weights, deliver="all")
        await bus.watch(c.STEP_METRICS, c.StepMetrics, on_metrics, deliver="new")
        await bus.watch(c.RUN_EVENTS, c.RunEvent, on_event, deliver="new")

    async def _supervise(self, cfg: LocalRunConfig) -> None:
        """Until the run ends: restart what dies (services with backoff, a nats-server or
        cluster node at once on its port and store), fail on a crash loop or the timeout."""
        deadline = time.monotonic() + cfg.local.timeout_s
        while not self.finished.is_set():
            for node in self.nats.nodes if self.nats is not None else []:
                if node.proc is not None and node.proc.poll() is not None:
                    _say(f"{node.name} exited with code {node.proc.returncode}; restarting it (same port, same store)")
                    # Clients reconnect by themselves; JetStream's store is on disk (a cluster
                    # node catches up from its peers, which served meanwhile).
                    node.start()
            for ch in self.children:
                if ch.restart_at is not None:
                    if time.monotonic() >= ch.restart_at:
                        ch.proc, ch.restart_at = spawn(ch.argv, ch.env, ch.log), None
                    continue
                if ch.proc.poll() is None:
                    continue
                # The learner ends by itself once the run is over. Its event may reach us
                # after its exit (or not at all, if the bus dropped us meanwhile): the
                # database row, written before the event, is the run's outcome.
                if ch.proc.returncode == 0 and ch.info.name == "learner":
                    try:
                        await asyncio.wait_for(self.finished.wait(), 2.0)
                        return
                    except TimeoutError:
                        status, detail = await self._run_status(cfg)
                        if status == "finished":
                            return
                        if status == "failed":
                            self.failed = detail or "the run failed"
                            return
                if why := self._restart(ch, cfg):
                    self.failed = why
                    return
            if time.monotonic() > deadline:
                self.failed = f"the run did not finish within {cfg.local.timeout_s:.0f}s"
                return
            try:
                await asyncio.wait_for(self.finished.wait(), 0.5)
            except TimeoutError:
                pass

    def _restart(self, ch: ServiceProcess, cfg: LocalRunConfig) -> str | None:
        """Schedule ``ch``'s restart; the run's failure instead when it crash-loops."""
        now = time.monotonic()
        local = cfg.local
        ch.restarts = [t for t in ch.restarts if now - t < local.restart_window_s] + [now]
        code = ch.proc.returncode
        if len(ch.restarts) > local.max_restarts:
            return (
                f"{ch.name} crash-loops: it exited {len(ch.restarts)} times within {local.restart_window_s:.0f}s "
                f"(last exit code {code}); last lines of {ch.log}:\n" + _tail(ch.log)
            )
        delay = min(local.restart_backoff_s * 2 ** (len(ch.restarts) - 1), local.restart_backoff_max_s)
        _say(
            f"{ch.name} exited with code {code}; restarting it in {delay:.1f}s (restart {len(ch.restarts)} of "
            f"at most {local.max_restarts} in {local.restart_window_s:.0f}s)"
        )
        ch.restart_at = now + delay
        self.restarts += 1
        return None

    def _stop_children(self, grace: float) -> None:
        for ch in sorted(self.children, key=lambda ch: -ch.info.order):
            ch.restart_at = None
            if ch.proc.poll() is None:
                ch.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace
        for ch in self.children:
            try:
                ch.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                ch.proc.kill()
                ch.proc.wait()

    async def run(self) -> int:
        run_dir, cfg = self._prepare()
        _say(
            f"run {cfg.run.id}: {cfg.algorithm.steps} steps of {cfg.algorithm.groups_per_step} groups x "
            f"{cfg.algorithm.samples_per_group} samples; results in {run_dir}"
        )
        interrupted = asyncio.Event()
        from kiln.shared.service import StopSignals  # never lost under load, unlike loop.add_signal_handler

        signals = StopSignals(
            asyncio.get_running_loop(), lambda _sig: (interrupted.set(), self.finished.set())
        ).install()
        bus = None
        dashboard, dashboard_stop = None, asyncio.Event()
        try:
            self._start_infra(cfg)
            cfg = load_config(LocalRunConfig, self.config_file)
            if self.creds is not None:
                from kiln.shared.bus.auth import ADMIN

                cfg.nats.user, cfg.nats.password = ADMIN, self.creds.users[ADMIN]
            bus = await Bus.connect(cfg.nats, "launcher")
            await bus.ensure_topology()
            await self._watch(bus, cfg.run.id, cfg.algorithm.steps)
            if cfg.local.dashboard:
                from kiln.ops.dashboard.serve import serve_dashboard

                url, dashboard = await serve_dashboard(
                    cfg.database.url,
                    "127.0.0.1",
                    cfg.local.dashboard_port,
                    "",
                    dashboard_stop,
                    traces_dir=self.run_dir / "traces",
                )
                _say(f"dashboard: {url}/runs/{cfg.run.id}")
            self._spawn(cfg)
            await self._supervise(cfg)
        finally:
            _say("stopping services")
            self._stop_children(cfg.local.stop_grace_s)
            if dashboard:
                dashboard_stop.set()
                await dashboard
            if bus:
                await bus.close()
            summary = ""
            if cfg.database.url:
                if self.failed or interrupted.is_set():
                    await self._mark_failed(cfg, "interrupted" if interrupted.is_set() else self.failed or "")
                try:
                    summary = await self._summary(cfg)
                except Exception as e:  # never hide the run's own outcome behind a summary error
                    summary = f"(summary unavailable: {e})"
            if self.pg:
                self.pg.stop()
            if self.nats:
                self.nats.stop()
            signals.close()
        if interrupted.is_set():
            _say("interrupted")
            return 130
        if self.failed:
            _say(f"FAILED: {self.failed}")
            return 1
        print(summary, flush=True)
        return 0

    async def _run_status(self, cfg: LocalRunConfig) -> tuple[str | None, str]:
        from kiln.shared.db import Database, Run

        db = Database(cfg.database.url)
        try:
            async with db.session() as s:
                run = await s.get(Run, cfg.run.id)
                return (run.status, run.detail or "") if run is not None else (None, "")
        finally:
            await db.close()

    async def _mark_failed(self, cfg: LocalRunConfig, why: str) -> None:
        from sqlalchemy import update

        from kiln.shared.db import Database, Run

        db = Database(cfg.database.url)
        try:
            async with db.session() as s:
                await s.execute(
                    update(Run)
                    .where(Run.id == cfg.run.id, Run.status == "running")
                    .values(status="failed", detail=why[:4000])
                )
        except Exception as e:  # the database may be what failed; the exit code still says so
            _say(f"could not mark the run failed in the database: {e}")
        finally:
            await db.close()

    async def _summary(self, cfg: LocalRunConfig) -> str:
        from sqlalchemy import func, select

        from kiln.shared.db import Database, EvalRecord, PolicyVersion, TaskGroup

        db = Database(cfg.database.url)
        try:
            async with db.session() as s:
                versions = (
                    await s.scalar(
                        select(func.count()).select_from(PolicyVersion).where(PolicyVersion.run_id == cfg.run.id)
                    )
                ) or 0
                rows = (
                    await s.execute(
                        select(TaskGroup.status, TaskGroup.reason, func.count())
                        .where(TaskGroup.run_id == cfg.run.id)
                        .group_by(TaskGroup.status, TaskGroup.reason)
                    )
                ).all()
                evals = (
                    await s.scalars(
                        select(EvalRecord)
                        .where(EvalRecord.run_id == cfg.run.id)
                        .order_by(EvalRecord.version, EvalRecord.id)
                    )
                ).all()
        finally:
            await db.close()
        groups = ", ".join(f"{n} {st}{f' ({r})' if r else ''}" for st, r, n in rows) or "none"
        lines = [
            "",
            f"run {cfg.run.id} finished: {versions} policy versions stored (0..{versions - 1}), groups: {groups}"
            + (f"; {self.restarts} service restarts" if self.restarts else ""),
            f"  results:  {self.run_dir}",
            f"  config:   {self.config_file}",
            f"  logs:     {self.run_dir / 'logs'}",
            f"  traces:   {self.run_dir / 'traces'}",
            f"  weights:  {self.run_dir / 'weights'}",
            f"  database: {cfg.database.url}"
            + (f" (embedded, stopped; its data: {self.pg.data_dir})" if self.pg else ""),
            f"  browse:   kiln dashboard {self.run_dir}",
        ]
        for e in evals:
            ks = "".join(f", pass@{k} {v:.0%}" for k, v in e.pass_at_k.items())
            lines.append(
                f"  eval:     version {e.version}: greedy pass {e.greedy_pass_rate:.0%}{ks} ({e.tasks} {e.split} tasks)"
            )
        return "\n".join(lines)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def run_local(config_path: str | None, overrides: list[str]) -> int:
    return asyncio.run(LocalPlatform(config_path, overrides).run())
