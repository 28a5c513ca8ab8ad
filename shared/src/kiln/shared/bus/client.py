"""A small bus client over nats-py: JetStream publish/consume, request/reply, fan-out.

Invariants:

- a message a handler was given is settled exactly one way: acked (handler returned),
  naked with a delay (``Retry`` or an exception, until ``max_deliver``), or terminated
  after a copy went to the dead-letter stream with the reason (``Reject``, a message
  that fails validation, or the last failed delivery); a message whose worker dies is
  redelivered by JetStream after ``ack_wait`` because nothing settled it;
- while a handler runs (and while a handler ``hold()``s a delivery) the bus sends
  in-progress heartbeats, so slow work is not redelivered under a live worker;
- an invalid message never stops a consumer: it is dead-lettered and the loop goes on;
- the W3C trace context of the publisher travels in the headers and becomes the
  parent of the consumer's span;
- bodies above ``claim_check_bytes`` are stored in the ``kiln-claims`` object store
  and the message carries only the key (claim-check); requests and replies too (a
  request's claim is deleted once answered, a reply's once read).
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api
from opentelemetry import trace
from pydantic import ValidationError

from kiln.shared import contracts as c
from kiln.shared.bus import connect as busconnect
from kiln.shared.bus.delivery import Delivery, Handler, Reject, RemoteError, Retry, ServiceError
from kiln.shared.bus.topology import ensure_object_store, ensure_stream
from kiln.shared.config import NatsSettings
from kiln.shared.telemetry import extract_context, inject_headers

log = logging.getLogger("kiln.bus")

M = TypeVar("M", bound=c.Message)
R = TypeVar("R", bound=c.Message)


_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
    nats.js.errors.NoStreamResponseError,  # a cluster's stream between leaders answers nobody
)
"""Failures of a publish that a server coming back cures."""
_CONSUMER_REPLICAS_EXCEED_STREAM = 10126
"""JetStream's error code while a stream scaled up has not taken its new replicas yet."""


class Bus:
    def __init__(self, nc: nats.NATS, settings: NatsSettings, service: str, tracer: trace.Tracer | None = None):
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.service = service
        self.tracer = tracer or trace.get_tracer("kiln.bus")
        self._obs = None
        self._subs: list[Any] = []
        self.dead_letters = 0

    # --- lifecycle ------------------------------------------------------------

    @classmethod
    async def connect(cls, settings: NatsSettings, service: str, tracer: trace.Tracer | None = None) -> Bus:
        return cls(await busconnect.open_connection(settings, service), settings, service, tracer)

    async def close(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection may already be gone during shutdown
                pass
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except (
                nats.errors.ConnectionReconnectingError,
                nats.errors.ConnectionClosedError,
                nats.errors.Error,
                OSError,
            ):
                # The server is gone or going (a reset connection included): nothing left to flush.
                await self.nc.close()

    async def ensure_topology(self) -> None:
        """Create or update every stream, durable consumer and the claims store, each with
        ``nats.stream_replicas`` replicas; safe to call from every service. A stream that
        exists with other replicas is scaled (JetStream moves the data); a cluster still
        electing its leaders is waited for (up to ``nats.publish_retry_s``)."""
        replicas = self.settings.stream_replicas
        await self._until_available("JetStream", self._jetstream_answers)
        for spec in c.STREAMS:
            cfg = api.StreamConfig(
                name=spec.name,
                description=spec.description,
                subjects=list(spec.subjects),
                retention=api.RetentionPolicy(spec.retention.value),
                max_age=spec.max_age_s,
                duplicate_window=spec.duplicate_window_s,
                max_msgs_per_subject=spec.max_msgs_per_subject,
                storage=api.StorageType.FILE,
                num_replicas=replicas,
            )
            await self._until_available(f"stream {spec.name}", lambda cfg=cfg: ensure_stream(self.js, cfg))
        for spec in c.CONSUMERS:
            await self._until_available(f"consumer {spec.durable}", lambda spec=spec: self.ensure_consumer(spec))
        self._obs = await self._until_available(
            c.CLAIMS_BUCKET,
            lambda: self.object_store(c.CLAIMS_BUCKET, ttl_s=7 * 24 * 3600, description="claim-checked bodies"),
        )

    async def _jetstream_answers(self) -> None:
        """Raises a timeout until JetStream answers: asked with a short timeout, so a fresh
        cluster is used as soon as it has its leader, not after a 5 s request timeout."""
        try:
            await self.nc.jetstream(timeout=0.5).stream_info(c.STREAMS[0].name)
        except nats.js.errors.NotFoundError:
            pass

    async def _until_available(self, what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """``call()``, retried while JetStream is unavailable (a cluster electing leaders) or a
        stream is still being scaled (its consumers cannot have more replicas than it yet)."""
        give_up = time.monotonic() + self.settings.publish_retry_s
        delay = 0.1
        while True:
            try:
                return await call()
            except (*_TRANSIENT, nats.js.errors.BadRequestError) as e:
                scaling = (
                    isinstance(e, nats.js.errors.BadRequestError) and e.err_code == _CONSUMER_REPLICAS_EXCEED_STREAM
                )
                if isinstance(e, nats.js.errors.BadRequestError) and not scaling:
                    raise
                if time.monotonic() + delay > give_up:
                    raise
                log.info("JetStream not ready for %s (%s); retrying in %.1fs", what, type(e).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def object_store(self, bucket: str, *, ttl_s: float | None = None, description: str = ""):
        """The object store ``bucket``, created with ``nats.stream_replicas`` replicas when
        missing; one that exists with other replicas is scaled to them."""
        return await ensure_object_store(
            self.js, bucket, replicas=self.settings.stream_replicas, ttl_s=ttl_s, description=description
        )

    def ack_wait(self, spec: c.ConsumerSpec) -> float:
        return self.settings.ack_wait_s.get(spec.durable, spec.ack_wait_s)

    async def ensure_consumer(self, spec: c.ConsumerSpec) -> None:
        cfg = api.ConsumerConfig(
            durable_name=spec.durable,
            description=spec.description,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait(spec),
            max_deliver=spec.max_deliver,
            max_ack_pending=spec.max_ack_pending,
            filter_subject=spec.filter_subject,
            # As many as its stream: a consumer left on one node of a cluster dies with that
            # node (and work-queue streams demand it).
            num_replicas=self.settings.stream_replicas,
            **spec.overrides,
        )
        await self.js.add_consumer(spec.stream, cfg)

    async def _claims(self):
        if self._obs is None:
            self._obs = await self.js.object_store(c.CLAIMS_BUCKET)
        return self._obs

    # --- publish --------------------------------------------------------------

    async def publish(
        self,
        subject: str,
        msg: c.Message,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        context=None,
    ) -> api.PubAck:
        """JetStream publish; ``msg_id`` makes retries idempotent within the duplicate window."""
        hdrs = {c.HDR_TYPE: type(msg).__name__, **(headers or {})}
        inject_headers(hdrs, context)
        if msg_id:
            hdrs[c.HDR_MSG_ID] = msg_id
        data = msg.to_bytes()
        give_up = time.monotonic() + self.settings.publish_retry_s
        delay = 0.1
        while True:
            try:
                if len(data) > self.settings.claim_check_bytes and c.HDR_CLAIM not in hdrs:
                    key = f"{subject}/{msg_id or uuid.uuid4().hex}"
                    await (await self._claims()).put(key, data)
                    hdrs[c.HDR_CLAIM] = key
                return await self.js.publish(subject, b"" if c.HDR_CLAIM in hdrs else data, headers=hdrs)
            except _TRANSIENT as e:
                # The server is away (restarting, a cluster electing a leader): a lost publish
                # would leave work neither done nor failed, so wait for it to come back.
                if time.monotonic() + delay > give_up:
                    raise
                log.warning("publish to %s failed (%s: %s); retrying in %.1fs", subject, type(e).__name__, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _body(self, msg: Msg) -> bytes:
        key = (msg.headers or {}).get(c.HDR_CLAIM)
        if not key:
            return msg.data
        buf = io.BytesIO()
        await (await self._claims()).get(key, writeinto=buf)
        return buf.getvalue()

    async def dead_letter(self, subject: str, data: bytes, headers: dict[str, str] | None, reason: str) -> None:
        """Copy a rejected message, as received, to ``kiln.dlq.<subject>`` with the reason."""
        # Nats-* headers direct the server (dedupe id, expected stream or sequence): they
        # were meant for the original publish, and on the copy they could refuse it.
        hdrs = {k: v for k, v in (headers or {}).items() if not k.lower().startswith("nats-")}
        hdrs[c.HDR_DLQ_REASON] = reason[:2000].replace("\r", " ").replace("\n", " ")
        hdrs[c.HDR_DLQ_SUBJECT] = subject
        hdrs[c.HDR_DLQ_SERVICE] = self.service
        if len(data) > self.settings.claim_check_bytes:
            # A body near the server's limit would not fit beside the reason: it goes by
            # claim-check like any large body (the bus never sends a body with a claim, so
            # a message that had both loses only its forged reference).
            hdrs.pop(c.HDR_CLAIM, None)
            data = await self._claim_if_large(f"dlq/{subject}", data, hdrs)
        await self.js.publish(c.dead_letter_subject(subject), data, headers=hdrs)
        self.dead_letters += 1
        log.warning("dead-lettered a message from %s: %s", subject, reason[:300])

    # --- consume --------------------------------------------------------------

    async def consume(
        self,
        spec: c.ConsumerSpec,
        model: type[M],
        handler: Handler,
        *,
        stop: asyncio.Event,
        concurrency: int = 1,
        ready: asyncio.Event | None = None,
        before: tuple[c.ConsumerSpec, ...] = (),
        hold_back: Callable[[], bool] | None = None,
    ) -> None:
        """Pull from the durable ``spec`` and run ``handler`` until ``stop`` is set
        (``ready`` is set once the consumer is bound).

        ``before``: consumers (same message type) served first: every fetch tries them
        in order and takes from ``spec`` only when they have nothing. ``hold_back()``
        true: fetch from the ``before`` consumers only. ``concurrency`` bounds the
        handlers in flight across all of them."""
        order = (*before, spec)
        subs = []
        for sp in order:
            await self._until_available(f"consumer {sp.durable}", lambda sp=sp: self.ensure_consumer(sp))
            subs.append(
                (sp, await self.js.pull_subscribe_bind(durable=sp.durable, stream=sp.stream), self.ack_wait(sp))
            )
        if ready is not None:
            ready.set()
        running: set[asyncio.Task] = set()
        try:
            while not stop.is_set():
                free = concurrency - len(running)
                if free <= 0:
                    await asyncio.wait(running, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    continue
                held_back = hold_back is not None and hold_back()
                candidates = subs[:-1] if held_back else subs
                for n, (sp, psub, ack_wait) in enumerate(candidates):
                    last = n == len(candidates) - 1
                    try:
                        # Higher-priority consumers are polled briefly; the last one waits.
                        msgs = await psub.fetch(
                            batch=min(free, self.settings.fetch_batch), timeout=0.5 if last else 0.05
                        )
                    except (TimeoutError, nats.errors.TimeoutError):
                        continue
                    except (
                        nats.errors.ConnectionClosedError,
                        nats.errors.ConnectionReconnectingError,
                        OSError,
                        nats.errors.NoRespondersError,
                        nats.js.errors.ServiceUnavailableError,
                    ) as e:
                        # Reconnecting, or (a cluster) the consumer's leader moving to another node.
                        log.warning("fetch from %s failed (%s); retrying", sp.durable, e)
                        await asyncio.sleep(0.5)
                        break
                    for m in msgs:
                        t = asyncio.create_task(self._handle(sp, m, model, handler, ack_wait))
                        running.add(t)
                        t.add_done_callback(running.discard)
                    if msgs:
                        break
                else:
                    if not candidates:
                        await asyncio.sleep(0.5)
        finally:
            if running:
                await asyncio.gather(*running, return_exceptions=True)
            for _, psub, _ in subs:
                try:
                    await psub.unsubscribe()
                except Exception:
                    pass

    async def _handle(self, spec: c.ConsumerSpec, m: Msg, model: type[M], handler: Handler, ack_wait: float) -> None:
        md = m.metadata
        delivery: Delivery = Delivery(m, md.num_delivered, md.sequence.stream)
        hb = asyncio.create_task(self._heartbeat(delivery, ack_wait))
        try:
            try:
                data = await self._body(m)
            except Exception as e:  # claim expired or object store gone: nothing will fix it
                await self.dead_letter(m.subject, m.data, m.headers, f"claim-check body unavailable: {e}")
                await delivery.term()
                return
            try:
                obj = model.model_validate_json(data)
            except ValidationError as e:
                # The copy is the message as received (a claim-checked body stays by reference).
                await self.dead_letter(m.subject, m.data, m.headers, f"invalid {model.__name__}: {_short(e)}")
                await delivery.term()
                return
            ctx = extract_context(m.headers)
            with self.tracer.start_as_current_span(
                f"consume {m.subject}",
                context=ctx,
                kind=trace.SpanKind.CONSUMER,
                attributes={"messaging.destination": m.subject, "messaging.delivery": delivery.num_delivered},
            ):
                await handler(obj, delivery)
            if not delivery.held:
                await delivery.ack()
        except Reject as e:
            await self.dead_letter(m.subject, m.data, m.headers, f"rejected by {self.service}: {e}")
            await delivery.term()
        except Retry as e:
            if delivery.num_delivered >= spec.max_deliver:
                await self.dead_letter(m.subject, m.data, m.headers, f"retried {delivery.num_delivered} times: {e}")
                await delivery.term()
            else:
                log.info("retrying %s later: %s", m.subject, e)
                await delivery.nak(e.delay_s)
        except asyncio.CancelledError:
            # Graceful shutdown: hand the message back at once instead of after ack_wait.
            if not delivery.held:
                await asyncio.shield(delivery.nak())
            raise
        except Exception as e:
            log.exception("handler for %s failed (delivery %d/%d)", m.subject, delivery.num_delivered, spec.max_deliver)
            if delivery.num_delivered >= spec.max_deliver:
                await self.dead_letter(
                    m.subject,
                    m.data,
                    m.headers,
                    f"handler failed {delivery.num_delivered} times: {type(e).__name__}: {e}",
                )
                await delivery.term()
            else:
                await delivery.nak(min(30.0, 0.5 * 2 ** (delivery.num_delivered - 1)))
        finally:
            if not delivery.held or delivery.settled:
                hb.cancel()

    async def _heartbeat(self, delivery: Delivery, ack_wait: float) -> None:
        period = max(0.2, ack_wait / 3)
        while not delivery.settled:
            try:
                await asyncio.wait_for(delivery._done.wait(), period)
                return
            except TimeoutError:
                pass
            try:
                await delivery.msg.in_progress()
            except Exception as e:  # a reconnect loses nothing: the next beat or a redelivery covers it
                log.debug("in-progress heartbeat failed: %s", e)

    async def watch(
        self,
        subject: str,
        model: type[M],
        handler: Callable[[M], Awaitable[None]],
        *,
        deliver: str = "last_per_subject",
    ) -> None:
        """Fan-out: every caller gets every message on ``subject`` (an ordered, ephemeral
        consumer), starting from the last one per subject, or only new ones."""
        policy = {
            "last_per_subject": api.DeliverPolicy.LAST_PER_SUBJECT,
            "new": api.DeliverPolicy.NEW,
            "all": api.DeliverPolicy.ALL,
        }[deliver]

        async def cb(m: Msg) -> None:
            try:
                data = await self._body(m)
            except Exception as e:  # a claim that expired or never existed: nothing will fix it
                await self.dead_letter(m.subject, m.data, m.headers, f"claim-check body unavailable: {e}")
                return
            try:
                obj = model.model_validate_json(data)
            except ValidationError as e:
                await self.dead_letter(m.subject, m.data, m.headers, f"invalid {model.__name__}: {_short(e)}")
                return
            with self.tracer.start_as_current_span(
                f"receive {m.subject}", context=extract_context(m.headers), kind=trace.SpanKind.CONSUMER
            ):
                try:
                    await handler(obj)
                except Exception:
                    log.exception("watch handler for %s failed", m.subject)

        sub = await self.js.subscribe(
            subject,
            cb=cb,
            ordered_consumer=True,
            config=api.ConsumerConfig(deliver_policy=policy),
        )
        self._subs.append(sub)

    # --- request / reply --------------------------------------------------------

    async def request(self, subject: str, msg: c.Message, reply_model: type[R], *, timeout: float | None = None) -> R:
        hdrs = inject_headers({c.HDR_TYPE: type(msg).__name__})
        data = await self._claim_if_large(f"request/{subject}", msg.to_bytes(), hdrs)
        try:
            resp = await self.nc.request(
                subject, data, timeout=timeout or self.settings.request_timeout_s, headers=hdrs
            )
        except nats.errors.NoRespondersError as e:
            raise RemoteError("no_responders", f"nothing is serving {subject}") from e
        except nats.errors.TimeoutError as e:
            raise RemoteError(
                "timeout", f"{subject} did not answer within {timeout or self.settings.request_timeout_s}s"
            ) from e
        finally:
            if c.HDR_CLAIM in hdrs:
                await self._unclaim(hdrs[c.HDR_CLAIM])
        err = (resp.headers or {}).get(c.HDR_ERROR)
        if err:
            raise RemoteError(err, resp.data.decode(errors="replace"))
        body = await self._body(resp)
        if (resp.headers or {}).get(c.HDR_CLAIM):
            await self._unclaim(resp.headers[c.HDR_CLAIM])  # a reply has one reader: its claim goes now
        return reply_model.model_validate_json(body)

    async def _claim_if_large(self, prefix: str, data: bytes, hdrs: dict[str, str]) -> bytes:
        """A request or reply body above ``claim_check_bytes`` goes to the claims store
        (NATS caps a message at its max payload, 1 MiB by default): the body sent is
        empty and ``hdrs`` names the claim."""
        if len(data) <= self.settings.claim_check_bytes:
            return data
        key = f"{prefix}/{uuid.uuid4().hex}"
        await (await self._claims()).put(key, data)
        hdrs[c.HDR_CLAIM] = key
        return b""

    async def _unclaim(self, key: str) -> None:
        try:
            await (await self._claims()).delete(key)
        except Exception as e:  # the bucket's TTL collects it
            log.debug("could not delete claim %s: %s", key, e)

    async def serve(
        self,
        subject: str,
        request_model: type[M],
        handler: Callable[[M], Awaitable[c.Message]],
        *,
        queue: str = "",
        concurrency: int = 64,
    ) -> None:
        """Answer requests on ``subject`` (in queue group ``queue``), each in its own task."""
        slots = asyncio.Semaphore(concurrency)
        tasks: set[asyncio.Task] = set()

        async def answer(m: Msg) -> None:
            async with slots:
                try:
                    body = await self._body(m)
                except Exception as e:  # claim expired or object store gone
                    await self._reply_error(m, "invalid_request", f"claim-check body unavailable: {e}")
                    return
                try:
                    req = request_model.model_validate_json(body)
                except ValidationError as e:
                    reason = f"invalid {request_model.__name__}: {_short(e)}"
                    await self.dead_letter(m.subject, m.data, m.headers, reason)
                    await self._reply_error(m, "invalid_request", reason)
                    return
                with self.tracer.start_as_current_span(
                    f"serve {subject}", context=extract_context(m.headers), kind=trace.SpanKind.SERVER
                ):
                    try:
                        reply = await handler(req)
                    except ServiceError as e:
                        await self._reply_error(m, e.code, str(e))
                        return
                    except Exception as e:
                        log.exception("request handler for %s failed", subject)
                        await self._reply_error(m, "internal", f"{type(e).__name__}: {e}")
                        return
                if m.reply:
                    hdrs: dict[str, str] = {}
                    data = await self._claim_if_large("reply", reply.to_bytes(), hdrs)
                    await self.nc.publish(m.reply, data, headers=hdrs or None)

        async def cb(m: Msg) -> None:
            t = asyncio.create_task(answer(m))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        sub = await self.nc.subscribe(subject, queue=queue, cb=cb)
        self._subs.append(sub)
        # A round trip, so the server has the subscription before anyone is told we serve.
        await self.nc.flush()

    async def _reply_error(self, m: Msg, code: str, message: str) -> None:
        if m.reply:
            await self.nc.publish(m.reply, message.encode(), headers={c.HDR_ERROR: code})

    async def consumer_info(self, spec: c.ConsumerSpec):
        return await self.js.consumer_info(spec.stream, spec.durable)


def _short(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()[:5])
