"""Versions as files: the ``fs`` and ``http`` transports, and the files path every
other transport starts with (the first version) and falls back to.

A ``Source`` reads what the weights store holds (``FsSource``: its directory, shared
with the receiver; ``HttpSource``: the weights service's HTTP API). ``WeightReceiver``
turns a ``WeightsPublished`` into a local folder it has verified: in place when it shares
the store's disk and the version is stored full, otherwise in its own cache, rebuilding
delta versions from the newest version it already holds, or from the nearest full
version before the target (a receiver that missed versions catches up that way).

Invariant: ``fetch`` returns a folder only after every file matched the manifest's
sha256. A mismatch discards the copy and refetches once from the full chain; if that
fails too, ``IntegrityError`` is raised and the caller keeps serving what it had.
``VersionFiles`` picks the receiver for the store a version names; ``FilesFeed`` is the
feed of the files transports (and of every eval worker).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from abc import ABC, abstractmethod
from pathlib import Path

from kiln.shared.contracts import WeightsManifest, WeightsPublished
from kiln.shared.weights.delta import apply_delta
from kiln.shared.weights.manifest import MANIFEST, IntegrityError, verify
from kiln.shared.weights.transport.base import WeightFeed

log = logging.getLogger("kiln.weights.receiver")


class Source(ABC):
    @abstractmethod
    async def manifest(self, run_id: str, version: int) -> WeightsManifest: ...

    @abstractmethod
    async def download(self, run_id: str, version: int, rel: str, dest: Path) -> None: ...


class FsSource(Source):
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def version_dir(self, run_id: str, version: int) -> Path:
        return self.root / run_id / f"v{version:06d}"

    async def manifest(self, run_id: str, version: int) -> WeightsManifest:
        text = await asyncio.to_thread((self.version_dir(run_id, version) / MANIFEST).read_text)
        return WeightsManifest.model_validate_json(text)

    async def download(self, run_id: str, version: int, rel: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(shutil.copyfile, self.version_dir(run_id, version) / rel, dest)


class HttpSource(Source):
    """The weights service's HTTP API (``kiln.weights.api``), streamed to disk."""

    def __init__(self, base_url: str, token: str = "", timeout_s: float = 300.0):
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    async def manifest(self, run_id: str, version: int) -> WeightsManifest:
        r = await self.client.get(f"/runs/{run_id}/versions/{version}/manifest")
        r.raise_for_status()
        return WeightsManifest.model_validate_json(r.content)

    async def download(self, run_id: str, version: int, rel: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        async with self.client.stream("GET", f"/runs/{run_id}/versions/{version}/files/{rel}") as r:
            r.raise_for_status()
            with dest.open("wb") as f:
                async for chunk in r.aiter_bytes(1 << 20):
                    f.write(chunk)

    async def close(self) -> None:
        await self.client.aclose()


class WeightReceiver:
    def __init__(self, source: Source, cache_dir: str | Path | None = None, keep: int = 2):
        self.source = source
        self.cache = Path(cache_dir) if cache_dir else None
        self.keep = keep
        self.fetched_bytes = 0
        """Bytes this receiver downloaded (deltas count as their compressed size)."""

    def _local(self, run_id: str, version: int) -> Path:
        assert self.cache is not None
        return self.cache / run_id / f"v{version:06d}"

    async def fetch(self, msg: WeightsPublished) -> Path:
        m = msg.manifest
        if self.cache is None:
            if not isinstance(self.source, FsSource) or m.storage != "full":
                raise ValueError("a receiver without a cache directory can only read full versions in place")
            folder = self.source.version_dir(m.run_id, m.version)
            await asyncio.to_thread(verify, folder, m)
            return folder
        try:
            return await self._fetch(m, use_local=True)
        except (IntegrityError, ValueError) as e:
            log.warning("version %d failed verification (%s); refetching it from its full chain", m.version, e)
            shutil.rmtree(self._local(m.run_id, m.version), ignore_errors=True)
            return await self._fetch(m, use_local=False)

    def _have(self, run_id: str, version: int) -> bool:
        return (self._local(run_id, version) / ".verified").exists()

    async def _fetch(self, target: WeightsManifest, *, use_local: bool) -> Path:
        run = target.run_id
        if self._have(run, target.version):
            return self._local(run, target.version)
        path = [target]  # newest first, back to something we hold or a full version
        while path[-1].storage == "delta" and not (use_local and self._have(run, path[-1].base_version)):
            path.append(await self.source.manifest(run, path[-1].base_version))
        for m in reversed(path):
            dest = self._local(run, m.version)
            if self._have(run, m.version):
                continue
            shutil.rmtree(dest, ignore_errors=True)
            tmp = dest.with_name(dest.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            if m.storage == "full":
                for fi in m.files:
                    await self.source.download(run, m.version, fi.path, tmp / fi.path)
                    self.fetched_bytes += fi.size
            else:
                blob_path = tmp / "delta.kd"
                await self.source.download(run, m.version, m.delta.path, blob_path)
                blob = blob_path.read_bytes()
                self.fetched_bytes += len(blob)
                if hashlib.sha256(blob).hexdigest() != m.delta.sha256:
                    raise IntegrityError(f"delta of version {m.version} does not match its sha256")
                blob_path.unlink()
                await asyncio.to_thread(apply_delta, blob, self._local(run, m.base_version), tmp)
            await asyncio.to_thread(verify, tmp, m)
            (tmp / MANIFEST).write_text(m.model_dump_json(by_alias=True))
            (tmp / ".verified").touch()
            tmp.rename(dest)
        self._prune(run, target.version)
        return self._local(run, target.version)

    def _prune(self, run_id: str, newest: int) -> None:
        d = self.cache / run_id
        held = sorted(int(p.name[1:]) for p in d.iterdir() if p.name.startswith("v") and p.name[1:].isdigit())
        for v in held:
            if v not in held[-self.keep :] and v != newest:
                shutil.rmtree(self._local(run_id, v), ignore_errors=True)


class VersionFiles:
    """Where a worker reads a version's files: the store's directory in place when it can
    (shared disk, full versions, no cache asked for), otherwise rebuilt in its own cache;
    one ``WeightReceiver`` per store."""

    def __init__(self, http: bool, in_place: bool, cache_dir: Path, http_token: str = ""):
        self.http = http
        self.in_place = in_place and not http
        self.cache_dir = cache_dir
        self.http_token = http_token
        self._receivers: dict[str, WeightReceiver] = {}

    def receiver(self, msg: WeightsPublished) -> WeightReceiver:
        if self.http:
            if not msg.url:
                raise OSError("weights.transport.kind = 'http' but the weights service announced no HTTP URL")
            key, make = f"http:{msg.url}", lambda: HttpSource(msg.url, self.http_token)
        else:
            root = Path(msg.path).parents[1]
            key, make = f"fs:{root}", lambda: FsSource(root)
        if key not in self._receivers:
            self._receivers[key] = WeightReceiver(make(), None if self.in_place else self.cache_dir)
        return self._receivers[key]

    async def fetch(self, msg: WeightsPublished) -> Path:
        return await self.receiver(msg).fetch(msg)


class FilesFeed(WeightFeed):
    """``fs`` / ``http``: every version is read from its files."""

    async def _deliver(self, msg: WeightsPublished) -> None:
        await self._load_files(msg)
