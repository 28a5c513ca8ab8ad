"""weights entrypoint: ``python -m kiln.weights.main``.

Consumes ``PolicyCheckpoint``s (shared ``weights-writers`` consumer), stores each version
(full, or as a delta against the previous one), registers it in the database, applies
retention, then publishes ``WeightsPublished`` on ``kiln.weights.published.<run_id>``.
Serves the HTTP API receivers on other machines download from.

Invariant: a version is announced only after it is stored, verified and registered; a
redelivered checkpoint re-announces the same stored version (same ``Nats-Msg-Id``),
never a second copy; retention never deletes a pinned or tagged version or anything a
kept version needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import select, update

from kiln.shared import contracts as c
from kiln.shared.bus import Delivery, Reject
from kiln.shared.db import Database, PolicyVersion
from kiln.shared.http import serve_http
from kiln.shared.service import ServiceContext, service_main
from kiln.shared.weights.manifest import IntegrityError

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
    if w.http_port >= 0:
        url, http_task = await serve_http(build_app(store, db, w.http_token), w.http_host, w.http_port, w.http_token, ctx.stop)
    public_url = w.public_url or url
    broadcaster = Broadcaster(w) if w.broadcast_init_method else None

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
                    store.put, src, run_id=ck.run_id, version=ck.version, step=ck.step, parent_version=ck.parent_version,
                    files=ck.files or None,
                )  # fmt: skip
            except IntegrityError as e:  # the folder is not what the learner hashed: retrying cannot help
                raise Reject(str(e)) from e
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
        broadcast = broadcaster is not None and broadcaster.will_send()
        with ctx.tracer.start_as_current_span("weights.publish", attributes={"policy.version": ck.version}):
            await ctx.bus.publish(
                c.weights_published_subject(ck.run_id),
                c.WeightsPublished(
                    run_id=ck.run_id, version=ck.version, step=ck.step, path=str(stored.path), manifest=m,
                    manifest_sha256=stored.digest, url=public_url, broadcast=broadcast,
                ),
                msg_id=f"{ck.run_id}-v{ck.version}",
            )  # fmt: skip
        if broadcast:
            await broadcaster.send(ck.run_id, ck.version, src, m)
        ctx.health_detail["latest_version"] = ck.version
        ctx.metrics.published.add(1, {"storage": m.storage})
        ctx.metrics.version.set(ck.version)
        ctx.metrics.bytes.add(store.size_on_disk(ck.run_id, ck.version), {"storage": m.storage})
        ctx.metrics.seconds.record(time.monotonic() - t0)
        log.info("published version %d of %s (%s, %d bytes stored)", ck.version, ck.run_id, m.storage, store.size_on_disk(ck.run_id, ck.version))

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
                    .values(deleted_at=datetime.now(timezone.utc))
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


class Broadcaster:
    """Rank 0 of the engines' broadcast group (needs torch: ``kiln-weights[broadcast]``):
    torch.distributed (``nccl``/``gloo``) or vLLM's weight transfer (``vllm-nccl``). The
    group forms in the background, so the service serves before every engine joined;
    versions published before that reach engines through their files."""

    def __init__(self, w):
        self.world_size = w.broadcast_world_size
        self.vllm = w.broadcast_backend == "vllm-nccl"
        if self.vllm:
            from kiln.shared.weights.vllm_transfer import VllmTransferSender

            self.group = asyncio.ensure_future(asyncio.to_thread(VllmTransferSender, w.broadcast_init_method, w.broadcast_world_size))
        else:
            from kiln.shared.weights.broadcast import BroadcastGroup, BroadcastSettings

            settings = BroadcastSettings(w.broadcast_init_method, w.broadcast_world_size, 0, w.broadcast_backend)
            self.group = asyncio.ensure_future(asyncio.to_thread(BroadcastGroup, settings))
        self.lock = asyncio.Lock()

    def will_send(self) -> bool:
        """Whether the next version goes out over the group. torch.distributed receivers
        read a header per version, so every version is sent (once the group has formed);
        vLLM's receivers post a receive per version, so only once every engine has joined
        (a group that failed to form never sends)."""
        if not self.vllm:
            return True
        return self.group.done() and self.group.exception() is None

    async def send(self, run_id: str, version: int, folder: Path, manifest: c.WeightsManifest) -> None:
        from safetensors.torch import load_file

        group = await self.group
        async with self.lock:
            tensors: dict = {}
            for f in sorted({t.file for t in manifest.tensors.values()}):
                tensors.update(await asyncio.to_thread(load_file, str(folder / f)))
            if self.vllm:
                sent = await asyncio.to_thread(group.send, manifest, tensors)
            else:
                sent = await asyncio.to_thread(group.send, run_id, version, tensors)
        log.info("broadcast version %d to %d engines (%d bytes)", version, self.world_size - 1, sent)


def main() -> None:
    service_main("weights", WeightsConfig, serve)


if __name__ == "__main__":
    main()
