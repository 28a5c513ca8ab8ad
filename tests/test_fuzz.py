"""Malformed and random messages on every subject kiln consumes, against the real
services (in-process, over a real nats-server and a real PostgreSQL) while a run goes on.

Invariants checked:

- the fuzzed subjects are the ones the running services subscribe to (recorded from
  ``Bus.consume/watch/serve``), each declared in ``contracts`` with the model its
  subscriber validates; every such call in kiln's source was made by the fleet, so a
  new consumer cannot go unfuzzed;
- every malformed JetStream message ends in the dead-letter stream, once per
  subscriber that received it, as it was received (body and headers, a claim-check
  reference included), with a reason naming the model it failed or the missing claim;
- every malformed request gets an error reply with its reason (never a timeout), and
  a request that reached its handler's validation is dead-lettered too;
- valid messages with extreme values (NaN, infinities, huge numbers and strings, path
  tricks): every request still gets a reply its client can read or an error that is not
  an unhandled exception; every work item of another run is settled, and whatever is
  dead-lettered is refused at once with its reason, not retried until ``max_deliver``;
- afterwards no service has crashed, each answers its health probe, and valid
  messages are still processed end to end (training steps, an evaluation, a sandbox).

The cases are drawn by hypothesis, bounded and derandomized: every run sends the
same messages. The default tier sends a few dozen per subject; ``slow`` many more.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections import Counter

import nats.errors
import nats.js.errors
import psycopg
import pytest
import pytest_asyncio
from fuzzing import (
    Case,
    Subscriptions,
    bus_call_sites,
    declared_model,
    direct_subscriptions,
    draw,
    encode,
    hostile,
    hostile_floats,
    hostile_text,
    is_valid,
    malformed,
    minimal,
)
from harness import InProcessPlatform, experiment, wait_for
from hypothesis import strategies as st

from kiln.ops.embedded import NatsServer
from kiln.ops.local_run import LocalPlatform
from kiln.shared import contracts as c
from kiln.shared.bus import Bus
from kiln.shared.config import EvalSettings, NatsSettings
from kiln.shared.db import Database, upgrade
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.evaluation import EvalCollector
from kiln.shared.tasks import load_suite
from kiln.shared.tools import TOOLS

pytestmark = pytest.mark.asyncio(loop_scope="module")


class Fleet:
    def __init__(self, platform, bus, subs, launcher, collector, run_id, db):
        self.platform, self.bus, self.subs = platform, bus, subs
        self.launcher, self.collector, self.run_id, self.db = launcher, collector, run_id, db


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory, postgres):
    """Every kiln service (rollout twice: a training and an eval worker) driving a long
    run, plus the two consumers that live outside services: ``kiln run``'s progress
    watch and an evaluation collector. Subscriptions are recorded while they start."""
    base = tmp_path_factory.mktemp("fuzz")
    server = NatsServer(base / "nats").start()
    name = f"t_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:{postgres.port}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    db_url = f"postgresql://postgres@127.0.0.1:{postgres.port}/{name}"
    upgrade(db_url)
    run_dir = base / "run"
    run_dir.mkdir()
    # Steps enough to outlast the test; the smallest groups that still train (2 samples).
    exp = experiment(
        run_dir,
        server.url,
        db_url,
        algorithm={"steps": 100_000, "groups_per_step": 1, "samples_per_group": 2, "group_deadline_s": 120},
        rollout={"max_turns": 1, "max_new_tokens": 8, "max_total_tokens": 2048},
        learner={"deadline_check_s": 0.5, "tokenizer_corpus_repeats": 1, "max_dropped_groups": 100_000},
    )
    subs = Subscriptions()
    mp = pytest.MonkeyPatch()
    subs.install(mp)
    platform = InProcessPlatform(exp)
    run_id = platform.config("learner").run.id
    bus = await Bus.connect(NatsSettings(url=server.url), "fuzzer")
    await bus.ensure_topology()
    db = Database(db_url)
    try:
        for svc in ("env-pool", "weights", "reward", "rollout"):
            await platform.start(svc)
        await platform.start("rollout", instance="rollout-eval", rollout={"role": "eval"})
        launcher = LocalPlatform(None, [])
        await launcher._watch(bus, run_id, 100_000)
        collector = EvalCollector(bus, db, load_suite(platform.config("learner").tasks.suite))
        await collector.watch()
        await platform.start("learner")
        yield Fleet(platform, bus, subs, launcher, collector, run_id, db)
    finally:
        mp.undo()
        try:
            await platform.stop_all()
        finally:
            await bus.close()
            await db.close()
            server.stop()


def targets(fleet: Fleet) -> dict[str, type[c.Message]]:
    """Subject -> the model its subscribers validate, as recorded."""
    return {subject: subs[0].model for subject, subs in fleet.subs.by_subject().items()}


async def test_every_consumed_subject_is_declared_and_recorded(fleet):
    seen = fleet.subs.by_subject()
    for subject, subs in seen.items():
        want = declared_model(subject)
        assert want is not None, f"{subject} is consumed ({subs[0].site}) but not declared in kiln.shared.contracts"
        for s in subs:
            assert s.model is want, (
                f"{s.service} reads {subject} as {s.model.__name__}; contracts declare {want.__name__}"
            )
    # Every durable consumer contracts declare has a running subscriber.
    assert {spec.filter_subject for spec in c.CONSUMERS} <= set(seen)
    # Every subscribing call in kiln's source ran in this fleet: nothing consumed goes unfuzzed.
    hit = {s.site for s in fleet.subs.seen}
    missing = [
        f"{path}:{first} ({method})"
        for path, first, last, method in bus_call_sites()
        if not any(f == path and first <= line <= last for f, line in hit)
    ]
    assert not missing, f"subscriptions the fuzz fixture does not start (add them to it): {missing}"
    assert not direct_subscriptions(), (
        f"services subscribing around the bus (no dead letters): {direct_subscriptions()}"
    )
    kinds = Counter(s.kind for s in fleet.subs.seen)
    assert kinds["consume"] >= 7 and kinds["watch"] >= 5 and kinds["serve"] >= 10, kinds


async def send(bus: Bus, subject: str, case: Case, hdrs: dict[str, str] | None, request: bool) -> str | None:
    """Send ``case``; for a request, the problem with its reply (None: a clear error).
    For a publish, "refused" when the server did not store it (its own header rules)."""
    if not request:
        try:
            ack = await bus.js.publish(subject, case.body, headers=hdrs)
        except nats.js.errors.APIError:
            return "refused"
        return "refused" if ack.duplicate else None
    try:
        resp = await bus.nc.request(subject, case.body, timeout=60, headers=hdrs)
    except nats.errors.TimeoutError:
        return "no reply within 60 s"
    code = (resp.headers or {}).get(c.HDR_ERROR)
    reason = resp.data.decode(errors="replace")
    if not code:
        return f"a success reply: {resp.data[:200]!r}"
    if not _names_problem(reason, declared_model(subject)):
        return f"error {code} without a reason: {reason[:300]!r}"
    return None


def _names_problem(reason: str, model: type[c.Message] | None) -> bool:
    return bool(model) and f"invalid {model.__name__}:" in reason or "claim-check body unavailable" in reason


async def dead_letters(bus: Bus) -> list:
    sub = await bus.js.pull_subscribe(f"{c.DEAD_LETTER_PREFIX}.>", stream="KILN_DLQ")
    out = []
    try:
        while True:
            try:
                batch = await sub.fetch(200, timeout=1)
            except TimeoutError:  # nats-py raises its own subclass or the plain one
                return out
            for m in batch:
                await m.ack()
            out.extend(batch)
    finally:
        await sub.unsubscribe()


async def fuzz(fleet: Fleet, per_subject: int) -> dict:
    """Send ``per_subject`` malformed messages to every consumed subject; check where
    each one ended. Returns counts for the report."""
    bus = fleet.bus
    subjects = targets(fleet)
    before = (await bus.js.stream_info("KILN_DLQ")).state.messages
    sent: Counter = Counter()  # (subject, body, claim key) -> dead letters expected
    problems: list[str] = []
    slots = asyncio.Semaphore(32)

    async def one(subject: str, case: Case, request: bool) -> None:
        hdrs = dict(case.headers) if case.headers is not None else None
        async with slots:
            if case.claim is not None:
                key = f"fuzz/{uuid.uuid4().hex}"
                await (await bus._claims()).put(key, case.claim)
                hdrs = {**(hdrs or {}), c.HDR_CLAIM: key}
            why = await send(bus, subject, case, hdrs, request)
        if why == "refused":
            return
        if why:
            problems.append(f"{subject} {case!r}: {why}")
            return
        # A request whose body was missing got only its error reply; anything else that
        # reached a model's validation is also dead-lettered by each subscriber.
        if not request or case.claim is not None or c.HDR_CLAIM not in (case.headers or {}):
            sent[(subject, case.body, (hdrs or {}).get(c.HDR_CLAIM))] += fleet.subs.copies(subject)

    jobs = []
    for subject, model in subjects.items():
        request = fleet.subs.by_subject()[subject][0].kind == "serve"
        stream = None if request else c.stream_for_subject(subject).name
        for case in draw(malformed(model, stream, bus.nc.max_payload), per_subject):
            jobs.append(one(subject, case, request))
    await asyncio.gather(*jobs)
    assert not problems, "\n".join(problems[:20])
    want = before + sum(sent.values())

    async def all_dead_lettered():
        assert not fleet.platform.failed(), fleet.platform.failed()
        return (await bus.js.stream_info("KILN_DLQ")).state.messages >= want

    try:
        await wait_for(all_dead_lettered, 120, 0.2, f"{want - before} dead letters")
    finally:
        got: Counter = Counter()
        ours = {key for _, _, key in sent}
        unclear = []
        for m in (await dead_letters(bus))[before:]:
            h = m.headers or {}
            subject, reason, key = h.get(c.HDR_DLQ_SUBJECT, ""), h.get(c.HDR_DLQ_REASON, ""), h.get(c.HDR_CLAIM)
            assert m.subject == c.dead_letter_subject(subject)
            if not _names_problem(reason, declared_model(subject)):
                unclear.append(f"{subject} from {h.get(c.HDR_DLQ_SERVICE)}: {reason[:300]!r}")
            data = m.data
            if key is not None and key not in ours:  # a body too large for a dead letter beside its reason
                data, key = await bus._body(m), None
            got[(subject, data, key)] += 1
        lost, extra = sent - got, got - sent
        assert not unclear, "dead-lettered without a reason that names the problem:\n" + "\n".join(unclear[:20])
        assert not lost and not extra, (
            f"lost (no dead letter): {[(s, b[:80], k, n) for (s, b, k), n in lost.items()][:10]}; "
            f"unexpected dead letters: {[(s, b[:80], k, n) for (s, b, k), n in extra.items()][:10]}"
        )
    return {"subjects": len(subjects), "messages": len(jobs), "dead_letters": want - before}


async def still_serving(fleet: Fleet) -> None:
    """No service crashed, each answers its health probe, and valid work still flows:
    two more training steps (rollout, reward, learner, weights and ``kiln run``'s
    watch in the loop), an evaluation recorded, a sandbox, a run event, and a valid
    message of another run taken off each work queue the run leaves idle."""
    p, bus = fleet.platform, fleet.bus
    assert not p.failed(), p.failed()
    assert all(not r.task.done() for r in p.running), [r.instance for r in p.running if r.task.done()]
    for name in {r.name for r in p.running}:
        reply = await bus.request(f"{c.HEALTH_PREFIX}.{name}", c.HealthProbe(), c.HealthReply, timeout=30)
        assert reply.service == name
    other = "fuzz-other-run"
    idle = [
        (
            c.ROLLOUT_RESUME,
            c.RolloutRequest(run_id=other, group_id="g", task_id="t", n_samples=1, dispatch_version=0, deadline=0.0),
        ),
        (c.ROLLOUT_ABANDONED, c.GroupAbandoned(run_id=other, group_id="g", reason="stale")),
    ]
    for subject, msg in idle:
        ack = await bus.publish(subject, msg)

        async def taken(ack=ack):
            try:
                await bus.js.get_msg(ack.stream, ack.seq)
                return False
            except nats.js.errors.NotFoundError:  # acked: a work queue keeps nothing done
                return True

        await wait_for(taken, 60, 0.1, f"a valid message on {subject} handled")
    pool = EnvPoolClient(bus)
    suite = load_suite(p.config("learner").tasks.suite)
    ref = await pool.create(suite.tasks[0].id)
    await pool.destroy(ref)
    steps = len(fleet.launcher.steps)

    async def trained_two_more():
        assert not p.failed(), p.failed()
        return len(fleet.launcher.steps) >= steps + 2

    await wait_for(trained_two_more, 180, 0.2, "two more training steps")
    weights = await latest_weights(bus, fleet.run_id)
    eval_id = f"fuzz-eval-{uuid.uuid4().hex[:6]}"
    settings = EvalSettings(max_tasks=1, samples=0, k=[1], timeout_s=120)
    await fleet.collector.start(fleet.run_id, eval_id, weights, settings, "builtin")
    assert await fleet.collector.wait(eval_id, 150) is not None, "the evaluation got nothing back"
    fleet.launcher.finished.clear()
    await bus.publish(c.RUN_EVENTS, c.RunEvent(run_id=fleet.run_id, kind="finished", detail="fuzz probe"))
    await asyncio.wait_for(fleet.launcher.finished.wait(), 30)
    assert not p.failed(), p.failed()


async def latest_weights(bus: Bus, run_id: str) -> c.WeightsPublished:
    """The newest announcement: a valid one, since versions were published after the fuzz."""
    m = await bus.js.get_last_msg("KILN_WEIGHTS", c.weights_published_subject(run_id))
    return c.WeightsPublished.model_validate_json(m.data)


def reply_model(subject: str) -> type[c.Message]:
    if subject == c.ENVPOOL_CREATE:
        return c.SandboxCreated
    if subject.startswith(c.HEALTH_PREFIX + "."):
        return c.HealthReply
    return c.ENVPOOL_NODE_MESSAGES[subject.rsplit(".", 1)[1]][1]


async def hostile_requests(fleet: Fleet, per_subject: int) -> int:
    """Valid requests with extreme values (NaN, infinities, path tricks, unknown or live
    sandboxes) to every request subject: each gets a reply its client can read, or an
    error that is not an unhandled exception in the handler."""
    bus = fleet.bus
    pool = EnvPoolClient(bus)
    suite = load_suite(fleet.platform.config("learner").tasks.suite)
    live = [await pool.create(suite.tasks[0].id) for _ in range(2)]
    ids = st.sampled_from([r.sandbox_id for r in live]) | hostile_text
    arguments = st.dictionaries(
        st.sampled_from(["path", "content", "pattern", "command", "query"]) | hostile_text, hostile_text, max_size=3
    )
    call = st.builds(
        lambda n, a: {"id": "1", "name": n, "arguments": a}, st.sampled_from(sorted(TOOLS)) | hostile_text, arguments
    )
    choices = {
        "sandbox_id": ids,
        "task_id": st.sampled_from([t.id for t in suite.tasks[:3]]) | hostile_text,
        "calls": st.lists(call, max_size=3),
        # A long finite timeout on a command that waits would only measure the timeout.
        "timeout_s": hostile_floats.filter(lambda x: not 30 < x < float("inf")),
    }
    problems, created = [], []
    slots = asyncio.Semaphore(16)

    async def one(subject: str, body: bytes) -> None:
        async with slots:
            try:
                resp = await bus.nc.request(subject, body, timeout=60)
            except nats.errors.TimeoutError:
                problems.append(f"{subject} {body[:200]!r}: no reply within 60 s")
                return
        code = (resp.headers or {}).get(c.HDR_ERROR)
        if code == "internal":
            problems.append(f"{subject} {body[:200]!r}: unhandled error: {resp.data[:300]!r}")
        elif not code:
            try:
                reply = reply_model(subject).model_validate_json(await bus._body(resp))
            except ValueError as e:
                problems.append(f"{subject} {body[:200]!r}: a reply its client cannot read: {str(e)[:300]}")
                return
            if isinstance(reply, c.SandboxCreated):
                created.append(reply.sandbox)

    jobs = []
    for subject, subs in fleet.subs.by_subject().items():
        if subs[0].kind == "serve":
            for d in draw(hostile(subs[0].model, choices).map(encode), per_subject):
                jobs.append(one(subject, d))
    try:
        await asyncio.gather(*jobs)
    finally:
        for ref in [*live, *created]:
            await pool.destroy(ref)
    assert not problems, f"{len(problems)} of {len(jobs)} requests:\n" + "\n".join(problems[:20])
    return len(jobs)


async def hostile_messages(fleet: Fleet, per_subject: int) -> int:
    """Valid messages of another run with extreme values to every JetStream subject: a
    work queue's message is settled (acked, or dead-lettered at once: a bad input that
    is retried until ``max_deliver`` is a handler that should have refused it)."""
    bus = fleet.bus
    before = (await bus.js.stream_info("KILN_DLQ")).state.messages
    stored: list[tuple[str, int]] = []
    for subject, subs in fleet.subs.by_subject().items():
        if subs[0].kind == "serve":
            continue
        for body in draw(hostile(subs[0].model, {"run_id": st.just("fuzz-other-run")}).map(encode), per_subject):
            ack = await bus.js.publish(subject, body)
            if c.stream_for_subject(subject).retention == c.Retention.WORK_QUEUE:
                stored.append((ack.stream, ack.seq))

    async def settled():
        assert not fleet.platform.failed(), fleet.platform.failed()
        for stream, seq in stored:
            try:
                await bus.js.get_msg(stream, seq)
                return False
            except nats.js.errors.NotFoundError:  # a work queue drops what was acked or terminated
                pass
        return True

    await wait_for(settled, 120, 0.2, "every hostile work message settled")
    retried = [
        f"{m.headers[c.HDR_DLQ_SUBJECT]}: {m.headers[c.HDR_DLQ_REASON][:300]}"
        for m in (await dead_letters(bus))[before:]
        if m.headers[c.HDR_DLQ_REASON].startswith(("handler failed", "retried"))
    ]
    assert not retried, "retried instead of refused:\n" + "\n".join(retried[:20])
    return len(stored)


@pytest.mark.timeout(300)
async def test_valid_messages_with_hostile_values_settle(fleet):
    t0 = time.monotonic()
    n = await hostile_messages(fleet, per_subject=10)
    print(f"hostile messages: {n} work items settled in {time.monotonic() - t0:.1f} s")


@pytest.mark.timeout(300)
async def test_requests_with_hostile_values_get_an_answer(fleet):
    t0 = time.monotonic()
    n = await hostile_requests(fleet, per_subject=20)
    print(f"hostile requests: {n} in {time.monotonic() - t0:.1f} s")


async def test_non_finite_or_negative_durations_are_refused(fleet):
    """Regression (found by the hostile requests): a NaN lease was never reaped, an
    infinite one renewed into a reply its client could not read (``expires_at: null``)."""
    pool = EnvPoolClient(fleet.bus)
    ref = await pool.create(load_suite(fleet.platform.config("learner").tasks.suite).tasks[0].id)
    node = functools.partial(c.envpool_node_subject, ref.node_id)
    try:
        for subject, body in [
            (c.ENVPOOL_CREATE, b'{"task_id": "x", "ttl_s": NaN}'),
            (c.ENVPOOL_CREATE, b'{"task_id": "x", "ttl_s": -5}'),
            (node("fork"), b'{"sandbox_id": "%s", "ttl_s": Infinity}' % ref.sandbox_id.encode()),
            (node("renew"), b'{"sandbox_id": "%s", "ttl_s": Infinity}' % ref.sandbox_id.encode()),
            (node("exec"), b'{"sandbox_id": "%s", "command": "true", "timeout_s": NaN}' % ref.sandbox_id.encode()),
        ]:
            resp = await fleet.bus.nc.request(subject, body, timeout=30)
            assert resp.headers[c.HDR_ERROR] == "invalid_request", (subject, body, resp.data)
            assert "ttl_s" in resp.data.decode() or "timeout_s" in resp.data.decode(), resp.data
    finally:
        await pool.destroy(ref)


async def test_non_finite_deadlines_are_malformed():
    """Regression: a RolloutRequest with a NaN deadline passed validation, leased every
    sample's sandbox for NaN seconds and was retried until dead-lettered with a reason
    about SandboxCreate; now it is malformed itself."""
    for model in (c.RolloutRequest, c.EvalRequest):
        ok = minimal(model)
        assert model.model_validate(ok)
        for bad in (b"NaN", b"Infinity", b"-Infinity"):
            body = encode(ok).replace(b'"deadline": 1.0', b'"deadline": ' + bad)
            assert bad in body and not is_valid(model, body)


@pytest.mark.timeout(300)
async def test_fuzz_every_consumed_subject(fleet):
    t0 = time.monotonic()
    stats = await fuzz(fleet, per_subject=20)
    t1 = time.monotonic()
    await still_serving(fleet)
    print(f"fuzz: {stats} in {t1 - t0:.1f} s; still serving checked in {time.monotonic() - t1:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_fuzz_every_consumed_subject_at_length(fleet):
    t0 = time.monotonic()
    stats = await fuzz(fleet, per_subject=300)
    t1 = time.monotonic()
    n = await hostile_requests(fleet, per_subject=200)
    n += await hostile_messages(fleet, per_subject=60)
    t2 = time.monotonic()
    await still_serving(fleet)
    print(
        f"fuzz (slow): {stats} in {t1 - t0:.1f} s; {n} hostile requests and work items in {t2 - t1:.1f} s;"
        f" still serving checked in {time.monotonic() - t2:.1f} s"
    )
