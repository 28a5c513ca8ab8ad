"""One trajectory's trace from the span files a local run writes (``telemetry.traces_file``,
``runs/<run-id>/traces/<service>.jsonl``), so traces are viewable without Jaeger.

``span_tree`` returns the trace's spans as a forest ordered by start time (one root,
the controller's dispatch, when every service exported its spans); a span whose
parent is missing from the files becomes a root of its own rather than vanishing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path


@dataclass
class Span:
    name: str
    service: str
    span_id: str
    parent_id: str | None
    start: datetime
    end: datetime
    attributes: dict
    children: list[Span] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return (self.end - self.start).total_seconds() * 1000


def _time(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def load_spans(traces_dir: Path, trace_id: str) -> list[Span]:
    if not trace_id or not traces_dir.is_dir():
        return []
    needle = f'"0x{trace_id.lower()}"'
    spans = []
    for f in sorted(traces_dir.glob("*.jsonl")):
        with f.open(errors="replace") as lines:
            for line in lines:
                if needle not in line:  # cheap filter before parsing
                    continue
                d = json.loads(line)
                spans.append(
                    Span(
                        name=d["name"],
                        service=d["resource"]["attributes"].get("service.name", f.stem),
                        span_id=d["context"]["span_id"],
                        parent_id=d.get("parent_id"),
                        start=_time(d["start_time"]),
                        end=_time(d["end_time"]),
                        attributes=d.get("attributes") or {},
                    )
                )
    return spans


def span_tree(traces_dir: Path, trace_id: str) -> list[Span]:
    spans = load_spans(traces_dir, trace_id)
    by_id = {s.span_id: s for s in spans}
    roots = []
    for s in sorted(spans, key=lambda s: s.start):
        parent = by_id.get(s.parent_id) if s.parent_id else None
        (parent.children if parent else roots).append(s)
    return roots
