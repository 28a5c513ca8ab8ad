"""The operator HTTP API of one env-pool node: ``/healthz``, ``/metrics``, ``/sandboxes``
(``kiln.shared.http``: loopback by default, a bearer token when bound wider)."""

from __future__ import annotations

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kiln.shared.http import bearer_auth


def build_app(node_id: str, pool, metrics, token: str) -> FastAPI:
    app = FastAPI(title=f"kiln env-pool {node_id}", docs_url=None, redoc_url=None)
    auth = Depends(bearer_auth(token))

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "node_id": node_id, "leased": len(pool.leases), "capacity": pool.s.max_sandboxes}

    @app.get("/metrics", dependencies=[auth])
    def prom() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/sandboxes", dependencies=[auth])
    def sandboxes() -> dict:
        return {"node_id": node_id, "sandboxes": pool.listing()}

    return app
