"""The process scaffold every kiln service runs in.

``run_service`` owns a service's lifetime: telemetry first and last (so shutdown
flushes every span), one bus connection, idempotent topology creation, a health
responder on ``kiln.health.<service>``, a liveness file for container healthchecks,
and a ``stop`` event set by SIGTERM/SIGINT that the service body watches to drain
its work. The body returns when it has finished; errors propagate and fail the
process (a supervisor restarts it; unacked work is redelivered).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Sequence, TypeVar

from opentelemetry.sdk.trace.export import SpanExporter

from kiln.shared import contracts as c
from kiln.shared.bus import Bus
from kiln.shared.config import ServiceConfig, load_config
from kiln.shared.http import bearer_auth, serve_http
from kiln.shared.telemetry import Telemetry, init_telemetry

log = logging.getLogger("kiln.service")

C = TypeVar("C", bound=ServiceConfig)


@dataclass
class ServiceContext:
    name: str
    instance: str
    config: ServiceConfig
    bus: Bus
    telemetry: Telemetry
    stop: asyncio.Event
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by the service body once it serves (subscriptions made, consumers bound)."""
    started_at: float = field(default_factory=time.time)
    health_detail: dict = field(default_factory=dict)
    failure: str = ""
    """Set by ``fail``: why this process cannot go on; it drains and exits non-zero."""

    _metrics: object = None
    metrics_url: str = ""
    """Where Prometheus scrapes this instance ("" when ``telemetry.metrics_port`` is -1)."""

    @property
    def tracer(self):
        return self.telemetry.tracer

    def fail(self, reason: str) -> None:
        """This process can do no more useful work (e.g. its inference engine died): stop
        it, so that its unacked messages go to the other replicas and whoever supervises
        it (``kiln run``, a container runtime) sees a failed service instead of a live
        one that fails every message it takes."""
        if not self.failure:
            log.critical("%s cannot go on: %s", self.instance, reason)
            self.failure = reason
        self.stop.set()

    @property
    def meter(self):
        """OpenTelemetry meter of the service: exported by OTLP and on ``/metrics``."""
        return self.telemetry.meter

    @property
    def metrics(self):
        """The service's instruments, as declared in ``kiln.shared.metrics`` (made once)."""
        if self._metrics is None:
            from kiln.shared.metrics import instruments

            self._metrics = instruments(self.meter, self.name)
        return self._metrics


class ServiceFailed(RuntimeError):
    """Raised out of ``run_service`` after ``ServiceContext.fail``: the process exits non-zero."""


def default_instance(name: str) -> str:
    return f"{name}-{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:4]}".replace(".", "-")


async def run_service(
    name: str,
    config: ServiceConfig,
    body: Callable[[ServiceContext], Awaitable[None]],
    *,
    instance: str | None = None,
    stop: asyncio.Event | None = None,
    install_signals: bool = True,
    set_global_telemetry: bool = True,
    extra_exporters: tuple[SpanExporter, ...] = (),
    ready: asyncio.Event | None = None,
) -> None:
    instance = instance or default_instance(name)
    tel = init_telemetry(
        name, config.telemetry, instance=instance, extra_exporters=extra_exporters, set_global=set_global_telemetry
    )
    stop = stop or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    bus = None
    beat = None
    metrics_stop, metrics_task = asyncio.Event(), None
    try:
        bus = await Bus.connect(config.nats, instance, tel.tracer)
        await bus.ensure_topology()
        ctx = ServiceContext(name, instance, config, bus, tel, stop, ready or asyncio.Event())
        if tel.prometheus is not None:
            t = config.telemetry
            ctx.metrics_url, metrics_task = await serve_http(metrics_app(tel.prometheus, t.metrics_token), t.metrics_host, t.metrics_port, t.metrics_token, metrics_stop)
            ctx.health_detail["metrics_url"] = f"{ctx.metrics_url}/metrics"
            log.info("metrics for Prometheus at %s/metrics", ctx.metrics_url)

        async def health(_: c.HealthReply) -> c.HealthReply:
            return c.HealthReply(
                service=name,
                instance=instance,
                uptime_s=time.time() - ctx.started_at,
                detail={"ready": ctx.ready.is_set(), **ctx.health_detail},
            )

        await bus.serve(f"{c.HEALTH_PREFIX}.{name}", c.HealthProbe, health)
        if config.telemetry.health_file:
            beat = asyncio.create_task(_liveness(Path(config.telemetry.health_file.replace("{service}", name)), stop))
        log.info("%s started as %s", name, instance)
        await body(ctx)
        if ctx.failure:
            raise ServiceFailed(f"{instance} failed: {ctx.failure}")
        if metrics_task and config.telemetry.metrics_linger_s > 0 and not stop.is_set():
            log.info("work done; metrics stay up for %.0f s for a last scrape", config.telemetry.metrics_linger_s)
            await wait_or_stop(stop, config.telemetry.metrics_linger_s)
        log.info("%s stopped", name)
    finally:
        if beat:
            beat.cancel()
        if metrics_task:
            # Health replies stop naming the endpoint before it goes away.
            ctx.health_detail.pop("metrics_url", None)
            metrics_stop.set()
            await metrics_task
        if bus:
            await bus.close()
        tel.shutdown()


def metrics_app(registry, token: str):
    """``/metrics`` in Prometheus' text format, behind the bearer token when one is set."""
    from fastapi import Depends, FastAPI
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = FastAPI(dependencies=[Depends(bearer_auth(token))])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _liveness(path: Path, stop: asyncio.Event) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    while not stop.is_set():
        path.touch()
        await wait_or_stop(stop, 5.0)


def service_main(
    name: str, config_cls: type[C], body: Callable[[ServiceContext], Awaitable[None]], argv: Sequence[str] | None = None
) -> None:
    """Entrypoint of ``python -m kiln.<service>.main [--config FILE] [--set k=v ...]``."""
    p = argparse.ArgumentParser(prog=f"kiln-{name}", description=f"kiln {name} service")
    p.add_argument("--config", help="experiment TOML file (default: $KILN_CONFIG)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--instance", help="instance id (default: host-pid-random)")
    args = p.parse_args(argv)
    config = load_config(config_cls, args.config, args.overrides)
    asyncio.run(run_service(name, config, body, instance=args.instance))


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to ``seconds``; True if ``stop`` was set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False
