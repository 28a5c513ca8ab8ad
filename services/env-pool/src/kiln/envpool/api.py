"""The operator HTTP API of one env-pool node: ``/healthz``, ``/metrics``, ``/sandboxes``.

Bound to 127.0.0.1 by default. Binding anything wider requires ``http_token``, and
with a token every route but ``/healthz`` demands ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import socket

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("kiln.envpool.api")


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside a kiln service: the service owns SIGTERM/SIGINT (its ``stop`` event)."""

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


def build_app(node_id: str, pool, metrics, token: str) -> FastAPI:
    app = FastAPI(title=f"kiln env-pool {node_id}", docs_url=None, redoc_url=None)

    def auth(request: Request) -> None:
        if token:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "node_id": node_id, "leased": len(pool.leases), "capacity": pool.s.max_sandboxes}

    @app.get("/metrics", dependencies=[Depends(auth)])
    def prom() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/sandboxes", dependencies=[Depends(auth)])
    def sandboxes() -> dict:
        return {"node_id": node_id, "sandboxes": pool.listing()}

    return app


async def serve_http(app: FastAPI, host: str, port: int, token: str, stop: asyncio.Event) -> tuple[str, asyncio.Task]:
    """Start uvicorn in this event loop; returns the URL and the server task."""
    if not is_loopback(host) and not token:
        raise ValueError(f"envpool.http_host = {host!r} listens beyond loopback: set envpool.http_token")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = _EmbeddedServer(uvicorn.Config(app, log_level="warning", lifespan="off"))

    async def run() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        await stop.wait()
        server.should_exit = True
        await serving

    return url, asyncio.create_task(run())
