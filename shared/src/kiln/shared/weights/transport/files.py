"""Versions as files: the ``fs`` and ``http`` transports, and the files path every
other transport starts with (the first version) and falls back to.

A ``Source`` reads what the weights store holds (``FsSource``: its directory, shared
with the receiver; ``HttpSource``: the weights service's HTTP API). ``WeightReceiver``
turns a ``WeightsPublished`` into a local folder it has verified: in place when it shares
the store's disk and the version is stored full, otherwise in its own cache, rebuilding
delta versions from the newest version it already holds, or from the nearest full
version before the target (a receiver that missed versions catches up that way).

Invariants:
- ``fetch`` returns a folder only after every byte of it is known to match the
  manifest: hashed on this node (a file read in place, or downloaded over HTTP), a
  kernel copy of a file hashed on this node (a full version copied from a shared store
  into the cache: the source's digest is taken from the node's ``VerifiedFiles``, and
  its stamp must not change across the copy), or, for a version rebuilt from a delta,
  ``verify_patched``: the chunks the delta patched are hashed, every other chunk is a
  copy of the base's and must carry the same digest in both manifests;
- a base a delta is applied to is itself a verified version of this cache (its folder
  has ``.verified`` and the manifest it was verified against), so the copied chunks
  are bytes that already matched a manifest;
- files of a cached version are never opened for writing once it is renamed into
  place (a rebuild writes only files it has just created), so hard links between
  versions of the cache are safe;
- a full version read in place is hashed once per node, not once per receiver (the
  node's ``VerifiedFiles``, keyed by inode).

A mismatch discards the copy and refetches once from the full chain (rebuilding every
version on the way, even ones held); if that fails too, ``IntegrityError`` is raised
and the caller keeps serving what it had.
``VersionFiles`` picks the receiver for the store a version names; ``FilesFeed`` is the
feed of the files transports (and of every eval worker).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import time
from abc import ABC, abstractmethod
from pathlib import Path

from kiln.shared.contracts import WeightsManifest, WeightsPublished
from kiln.shared.weights.delta import clone_file, patch_delta
from kiln.shared.weights.manifest import MANIFEST, IntegrityError, verify, verify_patched, verify_sizes
from kiln.shared.weights.transport.base import WeightFeed
from kiln.shared.weights.verified import NodeBuild, VerifiedFiles, default_root

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
        await asyncio.to_thread(clone_file, self.version_dir(run_id, version) / rel, dest)


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


def _stamp(path: Path) -> tuple:
    """What a write to ``path`` changes (not its ctime: the learner unlinking its own
    hard link to a stored file changes that, not the bytes)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class WeightReceiver:
    def __init__(
        self,
        source: Source,
        cache_dir: str | Path | None = None,
        keep: int = 2,
        verified: VerifiedFiles | None = None,
    ):
        self.source = source
        self.cache = Path(cache_dir) if cache_dir else None
        self.keep = keep
        if verified is None:
            verified = VerifiedFiles(default_root())
            verified.prune()  # records of long-gone inodes, once per receiver made
        self.verified = verified
        """This node's record of hashed files (shared by its receivers)."""
        self.fetched_bytes = 0
        """Bytes this receiver downloaded (deltas count as their compressed size)."""
        self.hashed_bytes = 0
        """Bytes this receiver hashed to verify what it fetched (deltas: the chunks they patched)."""
        self.last: dict = {}
        """The latest version made ready: its ``version``, ``how`` (``in place``, ``full``,
        ``delta``) and ``seconds`` from start to verified."""

    def _local(self, run_id: str, version: int) -> Path:
        assert self.cache is not None
        return self.cache / run_id / f"v{version:06d}"

    async def fetch(self, msg: WeightsPublished) -> Path:
        m = msg.manifest
        if self.cache is None:
            if not isinstance(self.source, FsSource) or m.storage != "full":
                raise ValueError("a receiver without a cache directory can only read full versions in place")
            folder = self.source.version_dir(m.run_id, m.version)
            t0 = time.perf_counter()
            before = self.verified.hashed
            await asyncio.to_thread(verify, folder, m, self.verified)
            if self.verified.hashed > before:
                self.hashed_bytes += sum(fi.size for fi in m.files)  # at most: some may have come from the record
            self.last = {"version": m.version, "how": "in place", "seconds": time.perf_counter() - t0}
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
            if use_local and self._have(run, m.version):
                continue
            build = NodeBuild(self.verified, hashlib.sha256(m.model_dump_json().encode()).hexdigest()[:32])
            await asyncio.to_thread(build.acquire)
            try:
                await self._make(m, build, use_local)
            finally:
                build.release()
        self._prune(run, target.version)
        return self._local(run, target.version)

    async def _make(self, m: WeightsManifest, build: NodeBuild, use_local: bool) -> None:
        """Version ``m`` into this cache, verified: linked from the node's build of it when
        there is one (not when refetching after a failure), else built here and published."""
        run = m.run_id
        t0 = time.perf_counter()
        dest = self._local(run, m.version)
        shutil.rmtree(dest, ignore_errors=True)
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        how = m.storage
        if use_local and build.link_into(tmp):
            how = "linked"
            await asyncio.to_thread(verify_sizes, tmp, m)
        elif m.storage == "full":
            await self._fetch_full(m, tmp)
        else:
            blob_path = tmp / "delta.kd"
            await self.source.download(run, m.version, m.delta.path, blob_path)
            blob = blob_path.read_bytes()
            self.fetched_bytes += len(blob)
            if hashlib.sha256(blob).hexdigest() != m.delta.sha256:
                raise IntegrityError(f"delta of version {m.version} does not match its sha256")
            blob_path.unlink()
            self.hashed_bytes += await asyncio.to_thread(self._rebuild, blob, self._local(run, m.base_version), tmp, m)
        (tmp / MANIFEST).write_text(m.model_dump_json(by_alias=True))
        self.last = {"version": m.version, "how": how, "seconds": time.perf_counter() - t0}
        (tmp / ".verified").touch()
        tmp.rename(dest)
        if how != "linked":
            build.publish(dest, [fi.path for fi in m.files])

    async def _fetch_full(self, m: WeightsManifest, tmp: Path) -> None:
        """A full version into ``tmp``, verified. From a shared store, each file's digest is
        the node's (hashed once per node) and the copy is the kernel's copy of those
        very bytes (the source's stamp is the same before and after); over HTTP, the
        downloaded bytes are hashed."""
        shared = isinstance(self.source, FsSource)
        for fi in m.files:
            src = self.source.version_dir(m.run_id, m.version) / fi.path if shared else None
            if shared:
                before = _stamp(src)
                hashed = self.verified.hashed
                if await asyncio.to_thread(self.verified.digest, src) != fi.sha256:
                    raise IntegrityError(
                        f"{fi.path} of version {m.version} in the store does not match its manifest sha256"
                    )
                self.hashed_bytes += fi.size if self.verified.hashed > hashed else 0
            await self.source.download(m.run_id, m.version, fi.path, tmp / fi.path)
            self.fetched_bytes += fi.size
            if shared and _stamp(src) != before:
                raise IntegrityError(f"{fi.path} of version {m.version} changed in the store while it was copied")
        if shared:
            await asyncio.to_thread(verify_sizes, tmp, m)
        else:
            await asyncio.to_thread(verify, tmp, m)
            self.hashed_bytes += sum(fi.size for fi in m.files)

    @staticmethod
    def _rebuild(blob: bytes, base: Path, tmp: Path, m: WeightsManifest) -> int:
        """Patch the verified ``base`` into ``tmp`` and verify it; returns the bytes hashed."""
        patched = patch_delta(blob, base, tmp)
        try:
            held = WeightsManifest.model_validate_json((base / MANIFEST).read_text())
        except (OSError, ValueError):  # a cache written before manifests were kept: hash it all
            verify(tmp, m)
            return sum(fi.size for fi in m.files)
        if held.version != m.base_version or held.run_id != m.run_id:
            raise IntegrityError(
                f"version {m.version} is a delta against {m.base_version}, the base held is {held.version}"
            )
        return verify_patched(tmp, m, held, patched)

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
