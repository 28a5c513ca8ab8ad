"""Operator HTTP APIs inside kiln services: uvicorn on the service's own event loop.

Policy every service shares: bind 127.0.0.1 by default; binding anything wider is
refused unless a token is configured; with a token, routes that depend on
``bearer_auth(token)`` demand ``Authorization: Bearer <token>`` (compared in constant
time). The service owns SIGTERM/SIGINT (its ``stop`` event), not uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import socket
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, HTTPException, Request


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_auth(token: str) -> Callable[[Request], None]:
    """A FastAPI dependency: no-op without a token, 401 unless the request carries it."""

    def check(request: Request) -> None:
        if token:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    return check


async def serve_http(
    app: FastAPI, host: str, port: int, token: str, stop: asyncio.Event, *, authenticates_itself: bool = False
) -> tuple[str, asyncio.Task]:
    """Start serving ``app`` until ``stop``; returns the URL and the server task.
    ``authenticates_itself``: every route of ``app`` checks a credential of its own (the
    rollout endpoint's per-episode keys), so a wider bind needs no shared token."""
    if not is_loopback(host) and not token and not authenticates_itself:
        raise ValueError(f"HTTP API on {host!r} listens beyond loopback: configure a token")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: without, a response written as headers then body
    # waits out the client's delayed ACK (~40 ms a request on Linux).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = _EmbeddedServer(uvicorn.Config(app, log_level="warning", lifespan="off"))

    async def run() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        await stop.wait()
        server.should_exit = True
        await serving

    return url, asyncio.create_task(run())
