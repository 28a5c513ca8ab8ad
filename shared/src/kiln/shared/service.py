"""The process scaffold every kiln service runs in.

``run_service`` owns a service's lifetime: telemetry first and last (so shutdown
flushes every span), one bus connection, idempotent topology creation, a health
responder on ``kiln.health.<service>``, a liveness file for container healthchecks,
and a ``stop`` event set by SIGTERM/SIGINT that the service body watches to drain
its work. The body returns when it has finished; errors propagate and fail the
process (a supervisor restarts it; unacked work is redelivered).

Invariant: the first SIGTERM or SIGINT sets ``stop``, however loaded the process is
(``StopSignals``). asyncio's ``loop.add_signal_handler`` cannot promise that: it learns
which signal came from a byte in the loop's self-pipe, which every
``call_soon_threadsafe`` (each ``asyncio.to_thread`` completion) also writes to; 278
wake-ups queued while the loop is busy fill it on Linux, the signal's byte is dropped
("Exception ignored when trying to write to the signal wakeup fd: BlockingIOError") and
its handler never runs (an env-pool node lived on 17 minutes after a SIGTERM that came
while it destroyed 1,000 sandboxes).
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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

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
    """Where Prometheus scrapes this instance ("" when ``telemetry.metrics.port`` is -1)."""

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


class StopSignals:
    """Calls ``on_signal(signum)`` on ``loop`` for each SIGTERM/SIGINT, never losing one.

    A Python-level handler (``signal.signal``: the interpreter runs it in the main thread
    whatever the self-pipe holds) queues the call with ``call_soon_threadsafe``, which
    puts it in the loop's ready queue before it writes its wake-up byte: a full pipe
    loses the byte, never the call (a full pipe is readable, so the loop wakes anyway).
    What remains is waking the main thread when the kernel delivers the signal to another
    thread, or just before the loop blocks in ``epoll_wait``: a wakeup fd of our own
    (read only here, so it never fills; ``warn_on_full_buffer=False`` all the same) wakes
    it at once, and a timer every ``poll_s`` bounds the wait should another library own
    the process's one wakeup fd. ``close`` restores the handlers and wakeup fd it replaced.
    Main thread only (the only thread Python lets install signal handlers)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_signal: Callable[[int], None],
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
        poll_s: float = 0.5,
    ) -> None:
        self.loop = loop
        self.on_signal = on_signal
        self.signals = tuple(signals)
        self.poll_s = poll_s
        self.received: list[int] = []
        """Every signal the handler saw, in order (appended in the handler itself)."""
        self._delivered = 0
        self._previous: dict[int, object] = {}
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def install(self) -> StopSignals:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        previous = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        if previous != -1:
            # Someone else's (an asyncio loop's self-pipe, say): it stays, as it already wakes
            # their loop; replacing it would silence their handlers. The timer bounds ours.
            signal.set_wakeup_fd(previous)
            r.close()
            w.close()
        else:
            self._wake = (r, w)
            self.loop.add_reader(r.fileno(), self._drain)
        self._timer = self.loop.call_later(self.poll_s, self._poll)
        return self

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
        if self._wake is not None:
            r, w = self._wake
            current = signal.set_wakeup_fd(-1)
            if current != w.fileno():  # somebody set theirs since: it stays
                signal.set_wakeup_fd(current)
            self.loop.remove_reader(r.fileno())
            r.close()
            w.close()
            self._wake = None

    def _handler(self, signum: int, _frame) -> None:
        self.received.append(signum)
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nothing is left to stop
            pass

    def _deliver(self) -> None:
        """Calls ``on_signal`` once per received signal, whichever of the handler's call and
        the timer comes first. Loop thread only; the handler may append meanwhile (what it
        appends after the slice is delivered by the call it queued)."""
        new = self.received[self._delivered :]
        self._delivered += len(new)
        for sig in new:
            self.on_signal(sig)

    def _drain(self) -> None:
        assert self._wake is not None
        try:
            while self._wake[0].recv(4096):
                pass
        except BlockingIOError:
            pass

    def _poll(self) -> None:
        self._deliver()
        self._timer = self.loop.call_later(self.poll_s, self._poll)


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
    signals = None
    if install_signals:

        def on_signal(signum: int) -> None:
            name_ = signal.Signals(signum).name
            if stop.is_set():
                log.warning("%s: %s while stopping; still draining", instance, name_)
            else:
                log.info("%s: %s, stopping", instance, name_)
            stop.set()

        signals = StopSignals(asyncio.get_running_loop(), on_signal).install()
    bus = None
    beat = None
    metrics_stop, metrics_task = asyncio.Event(), None
    try:
        bus = await Bus.connect(config.nats, instance, tel.tracer)
        await bus.ensure_topology()
        ctx = ServiceContext(name, instance, config, bus, tel, stop, ready or asyncio.Event())
        if tel.prometheus is not None:
            m = config.telemetry.metrics
            ctx.metrics_url, metrics_task = await serve_http(
                metrics_app(tel.prometheus, m.token), m.host, m.port, m.token, metrics_stop
            )
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
        try:
            if bus:
                await bus.close()
            tel.shutdown()
        finally:  # a signal during the drain above still only sets ``stop``
            if signals is not None:
                signals.close()


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
    except TimeoutError:
        return False
