"""Telemetry: structured logs carry service and trace ids; spans reach the trace file
(and every exporter) once the providers shut down."""

from __future__ import annotations

import json
import logging
import re

import pytest

from kiln.shared.config import TelemetrySettings
from kiln.shared.telemetry import (
    JsonFormatter,
    context_from_traceparent,
    extract_context,
    init_telemetry,
    inject_headers,
    trace_id_hex,
    traceparent,
)


def test_json_logs_carry_trace_ids(tmp_path):
    tel = init_telemetry("svc", TelemetrySettings(), set_global=False)
    fmt = JsonFormatter("svc")
    with tel.tracer.start_as_current_span("work") as span:
        record = logging.LogRecord("kiln.x", logging.INFO, __file__, 1, "hello %s", ("world",), None)
        line = json.loads(fmt.format(record))
    assert line["service"] == "svc" and line["msg"] == "hello world" and line["level"] == "INFO"
    assert line["trace_id"] == trace_id_hex(span) and len(line["span_id"]) == 16
    tel.shutdown()


def test_trace_file_gets_every_span_at_shutdown(tmp_path):
    path = tmp_path / "{service}.jsonl"
    tel = init_telemetry("svc", TelemetrySettings(traces_file=str(path)), set_global=False)
    with tel.tracer.start_as_current_span("parent") as parent:
        tp = traceparent(parent)
    with tel.tracer.start_as_current_span("child", context=context_from_traceparent(tp)):
        headers = inject_headers({})
    tel.shutdown()
    spans = [json.loads(x) for x in (tmp_path / "svc.jsonl").read_text().splitlines()]
    assert [s["name"] for s in spans] == ["parent", "child"]
    assert spans[1]["parent_id"] == spans[0]["context"]["span_id"]
    assert spans[0]["resource"]["attributes"]["service.name"] == "kiln-svc"
    assert headers["traceparent"].split("-")[1] == spans[1]["context"]["trace_id"].removeprefix("0x")
    assert extract_context(headers) is not None


async def test_metrics_outlive_finished_work_for_the_linger(nats_server, bus, caplog):
    """A service whose work ends by itself (the learner at the end of a run) keeps ``/metrics``
    up for ``metrics_linger_s``, so the last scrape sees the final values; a stop cuts the
    linger short, and health replies stop naming the endpoint before it closes."""
    import asyncio

    import httpx
    from harness import request_once_served, wait_for

    from kiln.shared import contracts as c
    from kiln.shared.config import NatsSettings, ServiceConfig
    from kiln.shared.service import run_service

    cfg = ServiceConfig(
        nats=NatsSettings(url=nats_server.url),
        telemetry=TelemetrySettings(log_format="text", metrics={"port": 0}, metrics_linger_s=60),
    )
    body_done, stop = asyncio.Event(), asyncio.Event()
    caplog.set_level(logging.INFO, logger="kiln.service")

    async def body(ctx):
        ctx.meter.create_counter("kiln_test_work_done").add(3)
        body_done.set()

    task = asyncio.create_task(
        run_service("lingerer", cfg, body, stop=stop, install_signals=False, set_global_telemetry=False)
    )
    await asyncio.wait_for(body_done.wait(), 20)
    # Past the point where the endpoint used to close: the service is in its linger.
    await wait_for(lambda: any("metrics stay up" in r.getMessage() for r in caplog.records), 20, 0.05, "the linger")
    h = await request_once_served(bus, f"{c.HEALTH_PREFIX}.lingerer", c.HealthProbe(), c.HealthReply)
    async with httpx.AsyncClient() as http:
        r = await http.get(h.detail["metrics_url"])
    assert r.status_code == 200 and re.search(r"^kiln_test_work_done_total\{.*\} 3.0$", r.text, re.M)
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 10)  # the stop ends the linger, not the 60 s
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(h.detail["metrics_url"])
