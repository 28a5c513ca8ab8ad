"""Sharing built layers between nodes through any S3-compatible service (AWS S3, MinIO, Ceph
RGW, Cloudflare R2...): one ``<prefix>/<digest>.tar.gz`` object per layer digest, packed and
unpacked like ``NatsLayerStore``'s, with the tarball's sha256 in the object's metadata and
checked before anything is unpacked.

The standard client (boto3, the ``kiln-envpool[s3]`` extra) runs in threads; layers stream
through a temporary file with multipart transfers, never whole in memory. Credentials come
from the standard AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``
and its files, an instance or pod role), never from kiln's configuration."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import tempfile
from pathlib import Path

from .store import _pack, _unpack

log = logging.getLogger(__name__)

SHA256_KEY = "kiln-sha256"
"""Metadata key (sent as ``x-amz-meta-kiln-sha256``) of the tarball's sha256, hex."""
CHUNK = 8 << 20


class LayerIntegrityError(Exception):
    """A stored layer whose bytes are not the ones that were stored (or carry no checksum)."""


def _sha256(f) -> str:
    f.seek(0)
    h = hashlib.sha256()
    while chunk := f.read(CHUNK):
        h.update(chunk)
    f.seek(0)
    return h.hexdigest()


def _not_found(e: Exception) -> bool:
    err = getattr(e, "response", {}).get("Error", {})
    return str(err.get("Code")) in ("404", "NoSuchKey", "NotFound")


class S3LayerStore:
    """``LayerStore`` over an S3 bucket. ``endpoint_url`` empty: AWS itself; any other
    endpoint is addressed path-style (``<endpoint>/<bucket>/<key>``), which MinIO, Ceph RGW
    and R2 all serve without per-bucket DNS names."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "kiln/environments",
        endpoint_url: str = "",
        region: str = "",
        scratch: Path | None = None,
        client=None,
    ):
        if not bucket:
            raise ValueError("S3LayerStore needs a bucket (envpool.environments.store.bucket)")
        self.bucket, self.prefix, self.scratch = bucket, prefix.strip("/"), scratch
        self.where = f"s3://{bucket}/{self.prefix}" + (f" at {endpoint_url}" if endpoint_url else "")
        self.client = client or _client(endpoint_url, region)

    def key(self, digest: str) -> str:
        return f"{self.prefix}/{digest}.tar.gz" if self.prefix else f"{digest}.tar.gz"

    async def _head(self, digest: str) -> dict | None:
        try:
            return await asyncio.to_thread(self.client.head_object, Bucket=self.bucket, Key=self.key(digest))
        except Exception as e:
            if _not_found(e):
                return None
            raise

    async def has(self, digest: str) -> bool:
        return await self._head(digest) is not None

    async def put(self, digest: str, path: Path) -> None:
        if await self.has(digest):
            return
        with tempfile.TemporaryFile(dir=self.scratch or path.parent) as tmp:
            await asyncio.to_thread(_pack, path, tmp)
            sha = await asyncio.to_thread(_sha256, tmp)
            await asyncio.to_thread(
                self.client.upload_fileobj,
                tmp,
                self.bucket,
                self.key(digest),
                ExtraArgs={"Metadata": {SHA256_KEY: sha}, "ContentType": "application/gzip"},
            )
        log.info("stored layer %s in %s", digest[:12], self.where)

    async def fetch(self, digest: str, dest: Path) -> bool:
        head = await self._head(digest)
        if head is None:
            return False
        key = self.key(digest)
        want = (head.get("Metadata") or {}).get(SHA256_KEY)
        if not want:
            raise LayerIntegrityError(
                f"layer {digest}: s3://{self.bucket}/{key} carries no {SHA256_KEY} checksum; not unpacked"
            )
        with tempfile.TemporaryFile(dir=self.scratch or dest.parent) as tmp:
            # Replaced between the head and the download: the sha256 below refuses it.
            await asyncio.to_thread(self.client.download_fileobj, self.bucket, key, tmp)
            got = await asyncio.to_thread(_sha256, tmp)
            if got != want:
                raise LayerIntegrityError(
                    f"layer {digest}: s3://{self.bucket}/{key} has sha256 {got}, stored as {want}; not unpacked"
                )
            await asyncio.to_thread(_unpack, tmp, dest)
        return True


def _client(endpoint_url: str, region: str):
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise RuntimeError("envpool.environments.store.kind = 's3' needs boto3: pip install 'kiln-envpool[s3]'") from e
    config = Config(retries={"mode": "standard"}, s3={"addressing_style": "path"} if endpoint_url else {})
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url or None, region_name=region or None, config=config
    )
