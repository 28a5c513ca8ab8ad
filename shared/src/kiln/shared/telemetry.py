"""Tracing, metrics and structured logging for every kiln process.

One OpenTelemetry trace follows one trajectory across services: the W3C trace
context travels in NATS message headers (``inject_headers`` / ``extract_context``),
and ``traceparent`` strings travel in message bodies where one message fans out into
several traces (``RolloutRequest.sample_traces``).

``init_telemetry`` must be paired with ``Telemetry.shutdown()``: the SDK's
``force_flush`` reports success even when an export failed, only ``shutdown`` drains
the batch processor, so a service that exits without it loses its last spans.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kiln.shared.config import TelemetrySettings

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass
class Telemetry:
    service: str
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    _files: list[Any] = field(default_factory=list)
    prometheus: Any = None
    """The ``CollectorRegistry`` the service's ``/metrics`` endpoint serves (None when off)."""
    _closed: bool = False

    @property
    def tracer(self) -> trace.Tracer:
        return self.tracer_provider.get_tracer(f"kiln.{self.service}")

    @property
    def meter(self) -> metrics.Meter:
        return self.meter_provider.get_meter(f"kiln.{self.service}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
        for f in self._files:
            f.close()


def init_telemetry(
    service: str,
    settings: TelemetrySettings,
    *,
    instance: str = "",
    extra_exporters: tuple[SpanExporter, ...] = (),
    set_global: bool = True,
    metric_readers: tuple[MetricReader, ...] = (),
) -> Telemetry:
    """Build tracer and meter providers for ``service`` and configure logging.

    ``extra_exporters`` are attached with a synchronous processor (tests use an
    in-memory exporter). ``set_global`` makes the providers the process-wide default,
    which a service process wants and in-process test harnesses with several services
    do not (each service keeps its own provider there).
    """
    resource = Resource.create({"service.name": f"kiln-{service}", "service.instance.id": instance or service})
    tp = TracerProvider(resource=resource)
    files = []
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=_otlp(settings.otlp_endpoint, "traces"))))
    if settings.traces_file:
        f = open(settings.traces_file.replace("{service}", service), "a", buffering=1)
        files.append(f)
        exporter = ConsoleSpanExporter(out=f, formatter=lambda s: json.dumps(json.loads(s.to_json())) + "\n")
        tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
    for exp in extra_exporters:
        tp.add_span_processor(SimpleSpanProcessor(exp))

    readers = list(metric_readers)
    registry = None
    if settings.metrics.port >= 0:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry

        # A registry per service, not prometheus_client's global one: in-process test
        # platforms run several services, each with its own endpoint.
        registry = CollectorRegistry()
        readers.append(PrometheusMetricReader(registry=registry))
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        readers.append(
            PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=_otlp(settings.otlp_endpoint, "metrics")),
                export_interval_millis=int(settings.metrics_interval_s * 1000),
            )
        )
    mp = MeterProvider(resource=resource, metric_readers=readers)
    if set_global:
        trace.set_tracer_provider(tp)
        metrics.set_meter_provider(mp)
        setup_logging(service, settings)
    return Telemetry(service, tp, mp, files, registry)


def _otlp(endpoint: str, signal: str) -> str:
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(f"/v1/{signal}") else f"{endpoint}/v1/{signal}"


# --- context propagation ----------------------------------------------------


def inject_headers(headers: dict[str, str], ctx: otel_context.Context | None = None) -> dict[str, str]:
    """Write the W3C trace context of ``ctx`` (default: current) into ``headers``."""
    _PROPAGATOR.inject(headers, context=ctx)
    return headers


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return _PROPAGATOR.extract(dict(headers or {}))


def traceparent(span: trace.Span) -> str:
    """The ``traceparent`` string of ``span``: a body-borne link to start a child trace from."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_from_traceparent(tp: str) -> otel_context.Context:
    return _PROPAGATOR.extract({"traceparent": tp}) if tp else otel_context.Context()


def trace_id_hex(span: trace.Span | None = None) -> str:
    span = span or trace.get_current_span()
    sc = span.get_span_context()
    return format(sc.trace_id, "032x") if sc.is_valid else ""


# --- logging ----------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line with the service and the active trace/span ids."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        sc = trace.get_current_span().get_span_context()
        if sc.is_valid:
            out["trace_id"] = format(sc.trace_id, "032x")
            out["span_id"] = format(sc.span_id, "016x")
        extra = getattr(record, "kiln", None)
        if extra:
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")


_logging_lock = threading.Lock()


def setup_logging(service: str, settings: TelemetrySettings) -> None:
    with _logging_lock:
        handler = logging.StreamHandler(sys.stderr)
        fmt = JsonFormatter(service) if settings.log_format == "json" else TextFormatter(service)
        handler.setFormatter(fmt)
        root = logging.getLogger()
        for h in list(root.handlers):
            if getattr(h, "_kiln", False):
                root.removeHandler(h)
        handler._kiln = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.setLevel(settings.log_level.upper())
        # nats-py logs every reconnect attempt at ERROR; the bus logs the state changes itself.
        logging.getLogger("nats.aio.client").setLevel(logging.CRITICAL)
