"""How a kiln client reaches NATS: the servers, its credential, TLS (``NatsSettings``).

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

import ssl
from pathlib import Path
from typing import Any

from kiln.shared.config import NatsSettings


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
