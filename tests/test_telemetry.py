"""Telemetry: structured logs carry service and trace ids; spans reach the trace file
(and every exporter) once the providers shut down."""

from __future__ import annotations

import json
import logging

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
