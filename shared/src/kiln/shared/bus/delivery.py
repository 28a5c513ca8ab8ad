"""What a bus handler is given and may raise: one JetStream delivery and the three
settlement signals.

Invariant: a ``Delivery`` is settled at most once (``ack``, ``nak`` or ``term``; later
calls are no-ops), so a handler, the bus and a holder can never settle it twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from nats.aio.msg import Msg

from kiln.shared import contracts as c

M = TypeVar("M", bound=c.Message)


class Reject(Exception):
    """Raised by a handler: this message can never succeed; dead-letter it with the reason."""


class Retry(Exception):
    """Raised by a handler: not now; redeliver after ``delay_s``. Each retry is a delivery:
    after ``max_deliver`` of them the message is dead-lettered, never silently dropped."""

    def __init__(self, reason: str, delay_s: float = 1.0):
        super().__init__(reason)
        self.delay_s = delay_s


class ServiceError(Exception):
    """Raised by a request handler: reply with this error (``code``) instead of a result."""

    def __init__(self, message: str, code: str = "error"):
        super().__init__(message)
        self.code = code


class RemoteError(Exception):
    """A request/reply call answered with an error."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class Delivery(Generic[M]):
    """One JetStream delivery as a handler sees it."""

    msg: Msg
    num_delivered: int
    stream_seq: int
    settled: bool = False
    held: bool = False
    _done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.msg.headers or {})

    def hold(self) -> None:
        """Keep the message unacked after the handler returns; the bus heartbeats it
        until the holder calls ``ack``/``nak``. Used by the learner, which acks a
        trajectory only once the step that trained it is published."""
        self.held = True

    async def ack(self) -> None:
        if not self.settled:
            self.settled = True
            self._done.set()
            await self.msg.ack()

    async def nak(self, delay_s: float | None = None) -> None:
        if not self.settled:
            self.settled = True
            self._done.set()
            await self.msg.nak(delay=delay_s)

    async def term(self) -> None:
        if not self.settled:
            self.settled = True
            self._done.set()
            await self.msg.term()


Handler = Callable[[M, Delivery], Awaitable[None]]
