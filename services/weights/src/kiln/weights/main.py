"""weights entrypoint: ``python -m kiln.weights.main``.

Consumes ``PolicyCheckpoint``s (shared ``weights-writers`` consumer), stores each version
(full, or as a delta against the previous one), registers it in the database, applies
retention, then publishes ``WeightsPublished`` on ``kiln.weights.published.<run_id>``.
Serves the HTTP API receivers on other machines download from, and pushes each version
over the configured transport's sender (``kiln.shared.weights.transport``).

Invariant: a version is announced only after it is stored, verified and registered; a
redelivered checkpoint re-announces the same stored version (same ``Nats-Msg-Id``),
never a second copy; retention never deletes a pinned or tagged version or anything a
kept version needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select, update

from kiln.shared import contracts as c
from kiln.shared.bus import Delivery, Reject
from kiln.shared.db import Database, PolicyVersion
from kiln.shared.http import serve_http
from kiln.shared.service import ServiceContext, service_main
from kiln.shared.weights.manifest import IntegrityError
from kiln.shared.weights.transport import make_sender
from kiln.weights.api import build_app
from kiln.weights.config import WeightsConfig, confined, staging_dir, store_dir
from kiln.weights.store import VersionStore

log = logging.getLogger("kiln.weights")


async def serve(ctx: ServiceContext) -> None:
    cfg: WeightsConfig = ctx.config  # type: ignore[assignment]
    w = cfg.weights
    store = VersionStore(store_dir(cfg, w.store_dir), delta=w.delta, keyframe_every=w.keyframe_every)
    db = Database(cfg.database.url, cfg.database.echo)
    url, http_task = "", None
    if w.http.port >= 0:
        url, http_task = await serve_http(
            build_app(store, db, w.http.token), w.http.host, w.http.port, w.http.token, ctx.stop
        )
    public_url = w.public_url or url
    sender = make_sender(w.transport)

    staging = staging_dir(cfg, w.staging_dir)

    async def on_checkpoint(ck: c.PolicyCheckpoint, delivery: Delivery) -> None:
        src = Path(ck.path)
        if why := await asyncio.to_thread(confined, src, staging):
            raise Reject(why)
        if not (src / "config.json").is_file():
            raise Reject(f"checkpoint folder {src} has no config.json")
        t0 = time.monotonic()
        with ctx.tracer.start_as_current_span("weights.store", attributes={"policy.version": ck.version}):
            try:
                stored = await asyncio.to_thread(
                    store.put,
                    src,
                    run_id=ck.run_id,
                    version=ck.version,
                    step=ck.step,
                    parent_version=ck.parent_version,
                    files=ck.files or None,
                )
            except IntegrityError as e:  # the folder is not what the learner hashed: retrying cannot help
                raise Reject(str(e)) from e
            except ValueError as e:  # a file name no path can hold (a NUL byte): retrying cannot help
                raise Reject(f"the checkpoint names a file no path can hold: {e}") from e
            m = stored.manifest
            async with db.session() as s:
                row = await s.get(PolicyVersion, (ck.run_id, ck.version))
                if row is None:
                    s.add(
                        PolicyVersion(
                            run_id=ck.run_id,
                            version=ck.version,
                            step=ck.step,
                            parent_version=ck.parent_version,
                            path=str(stored.path),
                            manifest_sha256=stored.digest,
                            num_bytes=sum(f.size for f in m.files),
                            stored_bytes=store.size_on_disk(ck.run_id, ck.version),
                            storage=m.storage,
                            base_version=m.base_version,
                        )
                    )
            await retain(ck.run_id)
        # Decided before the event: receivers of vllm-nccl post a receive exactly for the
        # versions the event marks, so the send below must follow the mark.
        broadcast = sender.will_send()
        with ctx.tracer.start_as_current_span("weights.publish", attributes={"policy.version": ck.version}):
            await ctx.bus.publish(
                c.weights_published_subject(ck.run_id),
                c.WeightsPublished(
                    run_id=ck.run_id,
                    version=ck.version,
                    step=ck.step,
                    path=str(stored.path),
                    manifest=m,
                    manifest_sha256=stored.digest,
                    url=public_url,
                    broadcast=broadcast,
                ),
                msg_id=f"{ck.run_id}-v{ck.version}",
            )
        if broadcast:
            await sender.send(ck.run_id, ck.version, src, m)
        ctx.health_detail["latest_version"] = ck.version
        ctx.metrics.published.add(1, {"storage": m.storage})
        ctx.metrics.version.set(ck.version)
        ctx.metrics.bytes.add(store.size_on_disk(ck.run_id, ck.version), {"storage": m.storage})
        ctx.metrics.seconds.record(time.monotonic() - t0)
        log.info(
            "published version %d of %s (%s, %d bytes stored)",
            ck.version,
            ck.run_id,
            m.storage,
            store.size_on_disk(ck.run_id, ck.version),
        )

    async def retain(run_id: str) -> None:
        if not w.keep_last:
            return
        async with db.session() as s:
            rows = (await s.scalars(select(PolicyVersion).where(PolicyVersion.run_id == run_id))).all()
            protected = {r.version for r in rows if r.pinned or r.tags}
            deleted = await asyncio.to_thread(store.retain, run_id, w.keep_last, protected)
            if deleted:
                await s.execute(
                    update(PolicyVersion)
                    .where(PolicyVersion.run_id == run_id, PolicyVersion.version.in_(deleted))
                    .values(deleted_at=datetime.now(UTC))
                )
                log.info("retention deleted versions %s of %s", deleted, run_id)

    ctx.health_detail["http_url"] = public_url
    try:
        await ctx.bus.consume(c.WEIGHTS_WRITERS, c.PolicyCheckpoint, on_checkpoint, stop=ctx.stop, ready=ctx.ready)
    finally:
        if http_task is not None:
            ctx.stop.set()
            await http_task
        await db.close()


def main() -> None:
    service_main("weights", WeightsConfig, serve)


if __name__ == "__main__":
    main()
