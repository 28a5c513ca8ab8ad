"""JetStream resources kiln declares, replicated (``nats.replicas``): streams and object
stores created or updated idempotently by any number of services at once.

Invariants:

- a resource that does not exist is created with the requested replicas; one that exists
  is updated to them (JetStream scales a stream up or down in place, keeping its data);
- two services declaring the same resource at once both succeed (the loser updates);
- a refusal caused by asking more replicas than the cluster has nodes says so.
"""

from __future__ import annotations

import logging

import nats.js.errors
from nats.js import api

log = logging.getLogger("kiln.bus")


def _exists(e: Exception) -> bool:
    return "already in use" in str(e) or "already exists" in str(e)


async def ensure_stream(js, cfg: api.StreamConfig) -> None:
    """Create the stream ``cfg`` describes, or update an existing one to it."""
    try:
        try:
            await js.stream_info(cfg.name)
        except nats.js.errors.NotFoundError:
            try:
                await js.add_stream(cfg)
                return
            except nats.js.errors.BadRequestError as e:
                if not _exists(e):
                    raise
                # another service created it meanwhile: update it below
        await js.update_stream(cfg)
    except nats.js.errors.APIError as e:
        raise replicas_hint(e, cfg.num_replicas or 1) from e


async def ensure_object_store(js, bucket: str, *, replicas: int = 1, ttl_s: float | None = None, description: str = ""):
    """The object store ``bucket`` of the JetStream context ``js``: created with ``replicas``
    when missing; an existing one keeps its settings but is scaled to ``replicas``."""
    try:
        try:
            obs = await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                return await js.create_object_store(
                    bucket,
                    config=api.ObjectStoreConfig(ttl=ttl_s or None, description=description or None, replicas=replicas),
                )
            except nats.js.errors.BadRequestError as e:
                if not _exists(e):
                    raise
                obs = await js.object_store(bucket)  # another service created it meanwhile
        info = await js.stream_info(f"OBJ_{bucket}")  # the stream behind an object store
        if info.config.num_replicas != replicas:
            log.info("scaling object store %s from %s to %d replicas", bucket, info.config.num_replicas, replicas)
            info.config.num_replicas = replicas
            await js.update_stream(info.config)
        return obs
    except nats.js.errors.APIError as e:
        raise replicas_hint(e, replicas) from e


def replicas_hint(e: Exception, replicas: int) -> Exception:
    """JetStream's refusal, with what usually causes it when replicas are involved."""
    text = str(e).lower()
    if replicas > 1 and ("replicas" in text or "insufficient" in text or "clustered" in text):
        return RuntimeError(
            f"{e}: nats.replicas (or nats.cluster_size) is {replicas}; does the NATS cluster have that many "
            "JetStream nodes? A single nats-server takes replicas = 1 only"
        )
    return e
