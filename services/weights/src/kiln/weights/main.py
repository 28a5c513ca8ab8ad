"""weights entrypoint: ``python -m kiln.weights.main``.

Consumes ``PolicyCheckpoint``s (shared ``weights-writers`` consumer), stores each as a
verified version folder with a manifest, registers it in the database, then publishes
``WeightsPublished`` on ``kiln.weights.published.<run_id>``. Invariant: a version is
announced only after it is stored, verified and registered; a redelivered checkpoint
re-announces the same stored version (same ``Nats-Msg-Id``), never a second copy.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from kiln.shared import contracts as c
from kiln.shared.bus import Delivery, Reject
from kiln.shared.db import Database, PolicyVersion
from kiln.shared.service import ServiceContext, service_main
from kiln.shared.weights_transport import FilesystemTransport

from kiln.weights.config import WeightsConfig, store_dir

log = logging.getLogger("kiln.weights")


async def serve(ctx: ServiceContext) -> None:
    cfg: WeightsConfig = ctx.config  # type: ignore[assignment]
    transport = FilesystemTransport(store_dir(cfg, cfg.weights.store_dir))
    db = Database(cfg.database.url, cfg.database.echo)

    async def on_checkpoint(ck: c.PolicyCheckpoint, delivery: Delivery) -> None:
        src = Path(ck.path)
        if not (src / "config.json").is_file():
            raise Reject(f"checkpoint folder {src} has no config.json")
        with ctx.tracer.start_as_current_span("weights.store", attributes={"policy.version": ck.version}):
            dest, manifest, digest = await asyncio.to_thread(
                transport.publish,
                src,
                dict(run_id=ck.run_id, version=ck.version, step=ck.step, parent_version=ck.parent_version),
            )
            async with db.session() as s:
                await s.merge(
                    PolicyVersion(
                        run_id=ck.run_id,
                        version=ck.version,
                        step=ck.step,
                        parent_version=ck.parent_version,
                        path=str(dest),
                        manifest_sha256=digest,
                        num_bytes=sum(f.size for f in manifest.files),
                    )
                )
        with ctx.tracer.start_as_current_span("weights.publish", attributes={"policy.version": ck.version}):
            await ctx.bus.publish(
                c.weights_published_subject(ck.run_id),
                c.WeightsPublished(
                    run_id=ck.run_id, version=ck.version, step=ck.step, path=str(dest), manifest=manifest, manifest_sha256=digest
                ),
                msg_id=f"{ck.run_id}-v{ck.version}",
            )
        ctx.health_detail["latest_version"] = ck.version
        log.info("published version %d of %s (%d bytes)", ck.version, ck.run_id, sum(f.size for f in manifest.files))

    try:
        await ctx.bus.consume(c.WEIGHTS_WRITERS, c.PolicyCheckpoint, on_checkpoint, stop=ctx.stop, ready=ctx.ready)
    finally:
        await db.close()


def main() -> None:
    service_main("weights", WeightsConfig, serve)


if __name__ == "__main__":
    main()
