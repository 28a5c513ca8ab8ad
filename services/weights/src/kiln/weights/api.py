"""The weights service's HTTP API: versions, manifests, files (streamed, with Range
requests), deltas, tags and pins. Loopback by default; a bearer token when bound wider
(``kiln.shared.http``)."""

from __future__ import annotations

from datetime import datetime

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import FileResponse, Response
from pydantic import BaseModel
from sqlalchemy import select

from kiln.shared.db import Database, PolicyVersion
from kiln.shared.http import bearer_auth
from kiln.weights.store import VersionStore


class Tag(BaseModel):
    tag: str


def _row(v: PolicyVersion) -> dict:
    return {
        "version": v.version,
        "step": v.step,
        "parent_version": v.parent_version,
        "storage": v.storage,
        "base_version": v.base_version,
        "num_bytes": v.num_bytes,
        "stored_bytes": v.stored_bytes,
        "tags": v.tags,
        "pinned": v.pinned,
        "published_at": v.published_at.isoformat() if isinstance(v.published_at, datetime) else v.published_at,
        "deleted": v.deleted_at is not None,
    }


def build_app(store: VersionStore, db: Database, token: str) -> FastAPI:
    app = FastAPI(title="kiln weights", docs_url=None, redoc_url=None)
    auth = [Depends(bearer_auth(token))]

    async def version_row(s, run_id: str, version: int) -> PolicyVersion:
        row = await s.get(PolicyVersion, (run_id, version))
        if row is None or row.deleted_at is not None:
            raise HTTPException(404, f"version {version} of {run_id} is not stored")
        return row

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/runs/{run_id}/versions", dependencies=auth)
    async def versions(run_id: str) -> dict:
        async with db.session() as s:
            rows = (
                await s.scalars(
                    select(PolicyVersion).where(PolicyVersion.run_id == run_id).order_by(PolicyVersion.version)
                )
            ).all()
        return {"run_id": run_id, "versions": [_row(r) for r in rows]}

    @app.get("/runs/{run_id}/versions/{version}/manifest", dependencies=auth)
    async def manifest(run_id: str, version: int) -> Response:
        try:
            body = store.file_path(run_id, version, "manifest.json").read_bytes()
        except FileNotFoundError:
            raise HTTPException(404, f"version {version} of {run_id} is not stored") from None
        return Response(body, media_type="application/json")

    @app.get("/runs/{run_id}/versions/{version}/files/{rel:path}", dependencies=auth)
    async def file(run_id: str, version: int, rel: str) -> FileResponse:
        try:
            path = store.file_path(run_id, version, rel)
        except FileNotFoundError:
            raise HTTPException(404, f"{rel} is not stored for version {version} of {run_id}") from None
        return FileResponse(path, media_type="application/octet-stream")  # streams; honours Range

    @app.post("/runs/{run_id}/versions/{version}/tags", dependencies=auth)
    async def add_tag(run_id: str, version: int, body: Tag) -> dict:
        async with db.session() as s:
            row = await version_row(s, run_id, version)
            row.tags = sorted(set(row.tags) | {body.tag})
            return _row(row)

    @app.delete("/runs/{run_id}/versions/{version}/tags/{tag}", dependencies=auth)
    async def remove_tag(run_id: str, version: int, tag: str) -> dict:
        async with db.session() as s:
            row = await version_row(s, run_id, version)
            row.tags = [t for t in row.tags if t != tag]
            return _row(row)

    @app.put("/runs/{run_id}/versions/{version}/pin", dependencies=auth)
    async def pin(run_id: str, version: int) -> dict:
        async with db.session() as s:
            row = await version_row(s, run_id, version)
            row.pinned = True
            return _row(row)

    @app.delete("/runs/{run_id}/versions/{version}/pin", dependencies=auth)
    async def unpin(run_id: str, version: int) -> dict:
        async with db.session() as s:
            row = await version_row(s, run_id, version)
            row.pinned = False
            return _row(row)

    return app
