"""Helpers of ``test_fuzz``: what kiln consumes, and malformed messages for it.

- ``Subscriptions`` records every ``Bus.consume`` / ``watch`` / ``serve`` a running
  service makes (subject, message model, queue group, call site), so the fuzz targets
  are what the services really listen to, checked against ``contracts``;
- ``bus_call_sites`` finds every such call in kiln's source, so a new consumer that
  the fuzz fixture does not start fails the test instead of going unfuzzed, and
  ``direct_subscriptions`` any service that subscribes around the bus;
- ``malformed(model, ...)`` is a hypothesis strategy of messages ``model`` must refuse
  (each case is checked to be invalid before it is sent); ``hostile(model)`` one of
  valid messages with extreme values; ``draw`` takes a bounded, derandomized sample of
  a strategy, so every run sends the same messages.
"""

from __future__ import annotations

import ast
import enum
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from kiln.shared import contracts as c
from kiln.shared.bus import Bus

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "shared" / "src", *sorted((ROOT / "services").glob("*/src"))]


# ---------------------------------------------------------------------------
# What is consumed
# ---------------------------------------------------------------------------


@dataclass
class Subscription:
    kind: str  # "consume" (durable pull), "watch" (fan-out), "serve" (request/reply)
    subject: str
    model: type[c.Message]
    service: str
    queue: str = ""
    site: tuple[str, int] = ("", 0)  # caller's file and line


@dataclass
class Subscriptions:
    seen: list[Subscription] = field(default_factory=list)

    def install(self, mp) -> None:
        """Wrap the three subscribing methods of ``Bus`` (``mp``: a MonkeyPatch). The
        wrappers are plain functions so the caller's frame is the call site even when
        the coroutine is handed to ``create_task``."""
        consume, watch, serve = Bus.consume, Bus.watch, Bus.serve
        seen = self.seen

        def site() -> tuple[str, int]:
            f = sys._getframe(2)
            return f.f_code.co_filename, f.f_lineno

        def rec_consume(bus, spec, model, handler, **kw):
            for sp in (*kw.get("before", ()), spec):
                seen.append(Subscription("consume", sp.filter_subject, model, bus.service, sp.durable, site()))
            return consume(bus, spec, model, handler, **kw)

        def rec_watch(bus, subject, model, handler, **kw):
            seen.append(Subscription("watch", subject, model, bus.service, "", site()))
            return watch(bus, subject, model, handler, **kw)

        def rec_serve(bus, subject, model, handler, **kw):
            seen.append(Subscription("serve", subject, model, bus.service, kw.get("queue", ""), site()))
            return serve(bus, subject, model, handler, **kw)

        mp.setattr(Bus, "consume", rec_consume)
        mp.setattr(Bus, "watch", rec_watch)
        mp.setattr(Bus, "serve", rec_serve)

    def by_subject(self) -> dict[str, list[Subscription]]:
        out: dict[str, list[Subscription]] = {}
        for s in self.seen:
            out.setdefault(s.subject, []).append(s)
        return out

    def copies(self, subject: str) -> int:
        """How many subscribers get (and so dead-letter) one message on ``subject``:
        every watcher and every plain subscriber; one per durable or queue group."""
        subs = self.by_subject()[subject]
        groups = {s.queue for s in subs if s.kind == "consume" or s.queue}
        return len(groups) + sum(1 for s in subs if s.kind != "consume" and not s.queue)


def declared_model(subject: str) -> type[c.Message] | None:
    """The model ``contracts`` declares for ``subject`` (None: not declared)."""
    for pattern, model in c.SUBJECT_MESSAGES.items():
        if c.subject_matches(pattern, subject):
            return model
    parts = subject.split(".")
    if subject.startswith("kiln.envpool.node.") and len(parts) == 5 and parts[4] in c.ENVPOOL_NODE_MESSAGES:
        return c.ENVPOOL_NODE_MESSAGES[parts[4]][0]
    if subject.startswith(c.HEALTH_PREFIX + ".") and len(parts) == 3:
        return c.HealthProbe
    return None


def direct_subscriptions() -> list[str]:
    """``file:line`` of every NATS subscription a service makes around the bus (which
    is what dead-letters what it cannot read)."""
    out = []
    for src in SOURCES[1:]:
        for path in src.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    if node.func.attr in ("subscribe", "pull_subscribe", "pull_subscribe_bind"):
                        out.append(f"{path}:{node.lineno}")
    return out


def bus_call_sites() -> list[tuple[str, int, int, str]]:
    """(file, first line, last line, method) of every ``<...>bus.consume/watch/serve(...)``
    in kiln's source."""
    out = []
    for src in SOURCES:
        for path in src.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                if node.func.attr not in ("consume", "watch", "serve"):
                    continue
                owner = node.func.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name == "bus":
                    out.append((str(path), node.lineno, node.end_lineno or node.lineno, node.func.attr))
    return out


# ---------------------------------------------------------------------------
# Valid messages (the base the mutations start from)
# ---------------------------------------------------------------------------


def minimal(model: type[BaseModel]) -> dict:
    """The smallest valid JSON object of ``model``: every required field, nothing else;
    built from the type hints so it follows the contracts as they change."""
    out = {}
    for name, f in model.model_fields.items():
        if f.is_required():
            out[f.alias or name] = _value(f.annotation)
    return out


def _value(tp):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return args[0]
    if origin in (typing.Union, types.UnionType):
        return _value(next(a for a in args if a is not type(None)))
    if origin is list or tp is list:
        return []
    if origin is dict or tp is dict:
        return {}
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return next(iter(tp)).value
        if issubclass(tp, BaseModel):
            return minimal(tp)
        return {str: "x", int: 1, float: 1.0, bool: False}[tp]
    return None


def is_valid(model: type[c.Message], body: bytes) -> bool:
    try:
        model.model_validate_json(body)
        return True
    except ValidationError:
        return False


# ---------------------------------------------------------------------------
# Malformed messages
# ---------------------------------------------------------------------------


@dataclass
class Case:
    kind: str
    body: bytes
    headers: dict[str, str] | None = None
    claim: bytes | None = None
    """Stored in the claims bucket under a fresh key, which the ``Kiln-Claim`` header
    names, before the message is sent (an object of another message: malformed for this
    subject). None with a ``Kiln-Claim`` header: a reference to nothing."""

    def __repr__(self) -> str:  # failures name the case without megabytes of body
        return f"Case({self.kind}, body={self.body[:120]!r}{'...' if len(self.body) > 120 else ''} ({len(self.body)} B), headers={self.headers})"


junk_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80)
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | junk_text
json_values = st.recursive(
    json_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(junk_text, kids, max_size=4), max_leaves=8
)
# Header names are tokens on the wire; values printable (NATS' text protocol: no CR/LF).
header_names = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)


def headers_for(stream: str | None) -> st.SearchStrategy[dict[str, str] | None]:
    """No headers at all, junk ones, or kiln's and NATS's own names with junk values:
    a broken trace context, a false type, a directive the server obeys (the right
    stream, so the publish is stored but a copy that keeps it elsewhere is refused)."""
    known = st.fixed_dictionaries(
        {},
        optional={
            "traceparent": header_values,
            c.HDR_TYPE: header_values,
            c.HDR_DLQ_REASON: header_values,
            **({"Nats-Expected-Stream": st.just(stream)} if stream else {}),
        },
    )
    return st.none() | st.dictionaries(header_names, header_values, max_size=3) | known


def malformed(model: type[c.Message], stream: str | None, max_payload: int) -> st.SearchStrategy[Case]:
    """Messages ``model`` must refuse, of every kind; ``stream``: the subject's stream
    (None: a request subject)."""
    base = minimal(model)
    keys = sorted({f.alias or n for n, f in model.model_fields.items()})
    required = sorted(base)
    hdrs = headers_for(stream)

    def obj(d) -> bytes:
        return json.dumps(d, ensure_ascii=False).encode()

    def replaced(k, v):
        return obj({**base, k: v})

    kinds = [
        st.builds(Case, st.just("random-bytes"), st.binary(max_size=300), hdrs),
        st.builds(Case, st.just("unicode-junk"), junk_text.map(str.encode), hdrs),
        st.builds(Case, st.just("json-wrong-shape"), json_values.map(obj), hdrs),
        st.builds(Case, st.just("wrong-type"), st.builds(replaced, st.sampled_from(keys), json_values), hdrs),
        st.builds(
            Case,
            st.just("schema-version"),
            st.integers(-5, 2**40).filter(lambda v: v != 1).map(lambda v: replaced("schema", v)),
            hdrs,
        ),
        st.builds(
            Case,
            st.just("extra-field"),
            st.builds(lambda k, v: obj({**base, k: v}), junk_text.filter(lambda k: k not in keys), json_values),
            hdrs,
        ),
        st.builds(
            Case, st.just("truncated"), st.integers(0, 200).map(lambda n: obj(base)[: n % max(1, len(obj(base)))]), hdrs
        ),
        st.builds(
            Case,
            st.just("huge-field"),
            st.integers(100_000, 600_000).map(lambda n: obj({**base, "x" * 8: "\u00e9" * (n // 2)})),
            st.none() | hdrs,
        ),
        st.builds(
            Case,
            st.just("forged-claim-missing"),
            st.binary(max_size=40),
            st.builds(lambda k: {c.HDR_CLAIM: k}, header_values.filter(str.strip)),
        ),
        st.builds(
            Case,
            st.just("forged-claim-other"),
            st.just(b""),
            st.just({c.HDR_CLAIM: ""}),
            st.binary(max_size=200)
            | json_values.map(obj)
            | st.integers(300_000, 1_500_000).map(lambda n: b"[" + b"1," * (n // 2) + b"x]"),
        ),
    ]
    if ranged := out_of_range(model):
        kinds.append(
            st.builds(Case, st.just("out-of-range"), st.sampled_from(ranged).map(lambda kv: replaced(*kv)), hdrs)
        )
    if required:
        without = st.sampled_from(required).map(lambda k: obj({x: v for x, v in base.items() if x != k}))
        kinds.append(st.builds(Case, st.just("missing-field"), without, hdrs))
    # One that fills a message to the server's limit: a copy with more headers must still fit.
    edge = Case("max-payload", b"[" + b"0," * ((max_payload - 400) // 2) + b"]", None)

    def refused(case: Case) -> bool:
        if case.claim is not None:
            return not is_valid(model, case.claim)
        return c.HDR_CLAIM in (case.headers or {}) or not is_valid(model, case.body)

    return st.one_of(*kinds, st.just(edge)).filter(refused)


def out_of_range(model: type[BaseModel]) -> list[tuple[str, object]]:
    """(field, value) pairs of the right JSON type that break a declared constraint: a
    bound (``ge``/``gt``/``le``/``lt``), a literal, an enum, finiteness."""
    out: list[tuple[str, object]] = []
    for name, f in model.model_fields.items():
        key = f.alias or name
        for m in f.metadata:
            for attr, delta in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
                bound = getattr(m, attr, None)
                if isinstance(bound, (int, float)) and not isinstance(bound, bool):
                    out.append((key, bound + delta))
            if getattr(m, "allow_inf_nan", True) is False:
                out.append((key, float("nan")))
        tp = f.annotation
        if typing.get_origin(tp) is typing.Literal:
            out.append((key, "not-" + str(typing.get_args(tp)[0])))
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            out.append((key, "not-a-member"))
    return out


def draw(strategy: st.SearchStrategy, n: int) -> list:
    """``n`` examples of ``strategy`` (fewer if it has fewer), the same on every run."""
    out: list = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(x):
        out.append(x)

    collect()
    return out


# ---------------------------------------------------------------------------
# Valid messages with hostile values (they pass validation and reach the handler)
# ---------------------------------------------------------------------------

hostile_floats = st.floats() | st.sampled_from([0.0, -1.0, 1e-9, 1e308, float("inf"), float("-inf"), float("nan")])
hostile_ints = st.integers(-(2**63), 2**63) | st.sampled_from([0, -1, 2**31, 2**64])
hostile_text = junk_text | st.sampled_from(
    ["", ".", "..", "../../etc/passwd", "/", "a" * 5000, "\x00", "*", ">", "kiln.>"]
)


def hostile(model: type[BaseModel], choices: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy[dict]:
    """JSON objects of ``model`` with extreme values (NaN, infinities, huge numbers, path
    tricks, NULs): the cases validation lets through. ``choices``: per-field strategies
    (real ids mixed in, so some requests reach a live sandbox)."""
    choices = choices or {}
    required, optional = {}, {}
    for name, f in model.model_fields.items():
        key = f.alias or name
        if key == "schema":
            continue
        (required if f.is_required() else optional)[key] = choices.get(key, _hostile(f.annotation))
    return st.fixed_dictionaries(required, optional=optional)


def _hostile(tp) -> st.SearchStrategy:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(st.none() if a is type(None) else _hostile(a) for a in args))
    if origin is list:
        return st.lists(_hostile(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(hostile_text, _hostile(args[1]) if args else json_values, max_size=3)
    if tp is typing.Any:
        return json_values
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return st.sampled_from([m.value for m in tp])
        if issubclass(tp, BaseModel):
            return hostile(tp)
        return {str: hostile_text, int: hostile_ints, float: hostile_floats, bool: st.booleans()}[tp]
    return json_values


def encode(d: dict) -> bytes:
    """JSON as a Python client would send it (NaN and infinities as the bare words
    Python writes, which pydantic reads)."""
    return json.dumps(d, ensure_ascii=False).encode()
