"""Sharing built layers between nodes: a tar.gz per layer digest in the NATS object store
(bucket ``kiln-environments``). ``S3LayerStore`` (s3.py) does the same over S3."""

from __future__ import annotations

import asyncio
import logging
import tarfile
import tempfile
from pathlib import Path

import nats.js.errors

from kiln.shared import contracts as c
from kiln.shared.bus.topology import ensure_object_store

from .unpack import extract_tar

log = logging.getLogger(__name__)


def _pack(path: Path, out) -> None:
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=3) as tf:
        tf.add(str(path), arcname=".", recursive=True)


def _unpack(src, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=src, mode="r:gz") as tf:
        extract_tar(tf, dest, owners=True)  # as packed: a root filesystem keeps its owners


class NatsLayerStore:
    """``LayerStore`` over a JetStream object store (``js``: a connected JetStream context)."""

    def __init__(
        self,
        js,
        bucket: str = c.ENVIRONMENTS_BUCKET,
        ttl_s: float = 0.0,
        scratch: Path | None = None,
        replicas: int = 1,
    ):
        self.js, self.bucket, self.ttl_s, self.scratch, self.replicas = js, bucket, ttl_s, scratch, replicas
        self._obs = None

    async def _store(self):
        if self._obs is None:
            self._obs = await ensure_object_store(
                self.js, self.bucket, replicas=self.replicas, ttl_s=self.ttl_s or None, description="environment layers"
            )
        return self._obs

    async def has(self, digest: str) -> bool:
        obs = await self._store()
        try:
            info = await obs.get_info(digest)
        except nats.js.errors.ObjectNotFoundError:
            return False
        return not info.deleted

    async def put(self, digest: str, path: Path) -> None:
        if await self.has(digest):
            return
        obs = await self._store()
        with tempfile.TemporaryFile(dir=self.scratch or path.parent) as tmp:
            await asyncio.to_thread(_pack, path, tmp)
            tmp.seek(0)
            await obs.put(digest, tmp)
        log.info("stored layer %s in %s", digest[:12], self.bucket)

    async def fetch(self, digest: str, dest: Path) -> bool:
        obs = await self._store()
        with tempfile.TemporaryFile(dir=self.scratch or dest.parent) as tmp:
            try:
                await obs.get(digest, writeinto=tmp)
            except nats.js.errors.ObjectNotFoundError:
                return False
            tmp.seek(0)
            await asyncio.to_thread(_unpack, tmp, dest)
        return True
