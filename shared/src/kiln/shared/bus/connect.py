"""How a kiln client reaches NATS: the servers, its credential, TLS (``NatsSettings``),
and the connection ``Bus.connect`` opens with them.

Invariants:

- every URL of ``nats.url`` (comma-separated: the nodes of a cluster) is offered to the
  client, which fails over between them and learns the rest from the cluster;
- the password is ``nats.password`` or the content of ``nats.password_file`` (a compose or
  Kubernetes secret), never both; a configured file that cannot be read fails at once;
- TLS is on when a CA file is given or a URL says ``tls://``: the server's certificate is
  verified against ``nats.tls_ca_file`` (else the system's CAs) and must name the URL's
  host; TLS 1.2 is the floor. There is no setting that skips verification. A server that
  does not demand TLS is refused by ``Bus.connect`` (nats-py upgrades only when the server
  asks, so that check comes after the greeting: the server's ``tls {}`` block is what
  keeps credentials off the wire in plain text).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from pathlib import Path
from typing import Any

import nats
import nats.errors

from kiln.shared.config import NatsSettings

log = logging.getLogger("kiln.bus")


def servers(settings: NatsSettings) -> list[str]:
    return [u.strip() for u in settings.url.split(",") if u.strip()]


def password(settings: NatsSettings) -> str:
    if settings.password_file:
        try:
            return Path(settings.password_file).read_text().strip()
        except OSError as e:
            raise ConnectionError(f"cannot read nats.password_file {settings.password_file}: {e}") from e
    return settings.password


def uses_tls(settings: NatsSettings) -> bool:
    return bool(settings.tls_ca_file) or any(u.startswith("tls://") for u in servers(settings))


def tls_context(settings: NatsSettings) -> ssl.SSLContext | None:
    """The client's TLS context, or None for a plain connection."""
    if not uses_tls(settings):
        return None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=settings.tls_ca_file or None)
        if settings.tls_cert_file:
            ctx.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    except (OSError, ssl.SSLError) as e:
        raise ConnectionError(f"cannot load the NATS TLS files (nats.tls_*): {e}") from e
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def connect_options(settings: NatsSettings) -> dict[str, Any]:
    """Keyword arguments of ``nats.NATS.connect`` for the servers, credential and TLS."""
    opts: dict[str, Any] = {"servers": servers(settings)}
    if settings.user:
        opts.update(user=settings.user, password=password(settings))
    if (ctx := tls_context(settings)) is not None:
        opts["tls"] = ctx
    return opts


def describe(settings: NatsSettings) -> str:
    """For error messages: where and as whom (no secret)."""
    return f"{settings.url} as {settings.user or 'no user'}" + (" over TLS" if uses_tls(settings) else "")


async def open_connection(settings: NatsSettings, service: str) -> nats.NATS:
    """A connected nats-py client that reconnects forever once connected; connecting at
    start-up is bounded by ``connect_timeout_s`` and fails with the reason (a refused
    credential, a certificate that does not verify, no server)."""
    nc: nats.NATS | None = None

    async def on_disconnect():
        if nc is not None and not (nc.is_closed or nc.is_draining):
            log.warning("disconnected from NATS")

    async def on_reconnect():
        log.info("reconnected to NATS")

    refused: list[str] = []
    tls_failed: list[BaseException] = []

    async def on_error(e):
        if isinstance(e, nats.errors.Error) and "authorization" in str(e).lower():
            refused.append(str(e))
        if isinstance(e, ssl.SSLError):  # nats-py reports a failed handshake here and retries
            tls_failed.append(e)
        log.debug("NATS client error: %s", e)

    opts = connect_options(settings)
    deadline = time.monotonic() + settings.connect_timeout_s
    while True:
        nc = nats.NATS()
        try:
            # A server that refuses the credential makes the client retry forever: bounded here.
            await asyncio.wait_for(
                nc.connect(
                    name=service,
                    connect_timeout=min(2.0, settings.connect_timeout_s),
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    allow_reconnect=True,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    error_cb=on_error,
                    **opts,
                ),
                max(0.5, deadline - time.monotonic()) + 2.0,
            )
            break
        except (TimeoutError, OSError, nats.errors.NoServersError, nats.errors.TimeoutError) as e:
            if refused or time.monotonic() > deadline:
                await nc.close()
                if isinstance(e, ssl.SSLError):
                    tls_failed.append(e)
                if refused:
                    why = f"the server refused the credential ({refused[-1]})"
                elif tls_failed:
                    why = (
                        f"TLS failed ({tls_failed[-1]}): is nats.tls_ca_file the CA that signed the server's "
                        "certificate, and does the certificate name the URL's host?"
                    )
                else:
                    why = str(e) or type(e).__name__
                raise ConnectionError(f"cannot connect to NATS at {describe(settings)}: {why}") from e
            await asyncio.sleep(0.2)
    if "tls" in opts and not (getattr(nc, "_server_info", None) or {}).get("tls_required"):
        # nats-py upgrades only when the server asks: a server without TLS must not pass
        # for one where the operator configured TLS.
        await nc.close()
        raise ConnectionError(f"NATS at {settings.url} does not speak TLS, but nats.tls_* / tls:// asks for it")
    return nc
