"""Manifests of policy versions: what a version holds and how to check a copy of it.

Every file of a version has its size and sha256 in the manifest, every tensor its dtype,
shape and file (read from the safetensors header, no torch needed). ``verify`` is the
gate every receiver passes before it serves a version.

Digests are taken where the bytes are made: the learner hashes the folder it staged
(``file_infos``) and hands the digests over with it; ``build_manifest`` then only checks
that the folder holds exactly those files at those sizes. A version is thus hashed once
at its source and once per node that serves a copy (``verify`` with the node's
``VerifiedFiles``: receivers that read the same inodes share one hash), and a byte that
changes anywhere between the learner's disk and a node is caught on that node.

Each file also carries the sha256 of each of its chunks (``FileInfo.chunks``, taken in
the same read as the whole-file digest): ``verify_patched`` checks a version rebuilt
from a verified base by re-hashing only the chunks a delta patched; every other chunk
is a copy of the base's, and must have the same digest in both manifests. A manifest
without chunk digests (written before they existed) verifies by whole-file hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kiln.shared.contracts import FileInfo, TensorInfo, WeightsManifest

MANIFEST = "manifest.json"


class IntegrityError(Exception):
    """A stored or received file does not match its manifest."""


MIN_CHUNK = 1 << 20
MAX_CHUNKS = 128
"""At most this many chunk digests per file (a 5 GB shard: 64 MiB chunks, 8 KB of
digests), so a manifest of a large model still fits in one bus message."""


def chunk_size(size: int) -> int:
    """Bytes per chunk for a file of ``size`` bytes: a power of two (so a multiple of
    every delta block), at least ``MIN_CHUNK``, at most ``MAX_CHUNKS`` chunks."""
    c = MIN_CHUNK
    while c * MAX_CHUNKS < size:
        c <<= 1
    return c


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def sha256_chunked(path: Path) -> tuple[str, int, list[str]]:
    """(sha256 of the file, chunk size, sha256 of each chunk), in one read."""
    size = path.stat().st_size
    chunk = chunk_size(size)
    whole, digests = hashlib.sha256(), []
    buf = bytearray(min(chunk, 4 << 20))
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        for _ in range(-(-size // chunk)):
            part, left = hashlib.sha256(), chunk
            while left and (n := f.readinto(view[: min(left, len(buf))])):
                whole.update(view[:n])
                part.update(view[:n])
                left -= n
            digests.append(part.hexdigest())
    return whole.hexdigest(), chunk, digests


def sha256_range(path: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        f.seek(offset)
        while length and (data := f.read(min(length, 4 << 20))):
            h.update(data)
            length -= len(data)
    return h.hexdigest()


def sha256_files(paths: list[Path]) -> list[str]:
    """sha256 of several files at once: hashlib drops the GIL on large updates, so the
    shards of a version hash on as many cores as there are shards."""
    if len(paths) <= 1:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_file, paths))


def safetensors_header(path: Path) -> dict:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _staged(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def file_infos(folder: Path, known=None) -> list[FileInfo]:
    """Size, sha256 and chunk digests of every file of a staged version (what its writer
    hands over). The digests go to ``known`` (default: this node's ``VerifiedFiles``), so
    that receivers on this node reading the same inodes (the store links them) need not
    hash them again."""
    from kiln.shared.weights.verified import SETTLE_NS, VerifiedFiles, default_root

    known = known if known is not None else VerifiedFiles(default_root())
    paths = _staged(folder)
    if known.root is not None and paths:  # one wait for the folder, not one per file per thread
        newest = max(p.stat().st_mtime_ns for p in paths)
        time.sleep(max(0, newest + SETTLE_NS - time.time_ns()) / 1e9)

    def one(p: Path):
        return known.hash_and_record(p, sha256_chunked)

    if len(paths) > 1:
        with ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1)) as pool:
            hashed = list(pool.map(one, paths))
    else:
        hashed = [one(p) for p in paths]
    return [
        FileInfo(path=str(f.relative_to(folder)), size=f.stat().st_size, sha256=digest, chunk=chunk, chunks=chunks)
        for f, (digest, chunk, chunks) in zip(paths, hashed)
    ]


def build_manifest(
    folder: Path,
    *,
    run_id: str,
    version: int,
    step: int,
    parent_version: int | None,
    files: list[FileInfo] | None = None,
) -> WeightsManifest:
    """The manifest of a staged version; ``files`` are the digests its writer took
    (``file_infos``): given, the folder must hold exactly those files at those sizes
    (``IntegrityError`` otherwise) and is not hashed again; None, it is hashed here."""
    paths = _staged(folder)
    if files is None:
        files = file_infos(folder)
    else:
        on_disk = {str(p.relative_to(folder)): p.stat().st_size for p in paths}
        listed = {fi.path: fi.size for fi in files}
        if on_disk != listed:
            raise IntegrityError(
                f"{folder} does not hold the files its writer listed: {on_disk} on disk, {listed} listed"
            )
        by_path = {fi.path: fi for fi in files}
        files = [by_path[str(p.relative_to(folder))] for p in paths]
    tensors = {}
    for f in paths:
        rel = str(f.relative_to(folder))
        if f.suffix == ".safetensors":
            for name, info in safetensors_header(f).items():
                if name != "__metadata__":
                    tensors[name] = TensorInfo(file=rel, dtype=info["dtype"], shape=info["shape"])
    return WeightsManifest(
        run_id=run_id, version=version, step=step, parent_version=parent_version, files=files, tensors=tensors
    )


def verify_sizes(folder: Path, manifest: WeightsManifest) -> None:
    """Every file of the manifest is in ``folder`` at its size (no hashing)."""
    for fi in manifest.files:
        f = folder / fi.path
        if not f.is_file():
            raise IntegrityError(f"{fi.path} is missing from {folder}")
        if f.stat().st_size != fi.size:
            raise IntegrityError(f"{fi.path} in {folder} has {f.stat().st_size} bytes, its manifest says {fi.size}")


def verify(folder: Path, manifest: WeightsManifest, known=None) -> None:
    """Every file of ``folder`` matches the manifest's sha256; ``known``: this node's
    ``VerifiedFiles``, so that a file another receiver of the node hashed is not hashed
    again."""
    verify_sizes(folder, manifest)
    paths = [folder / fi.path for fi in manifest.files]
    digests = known.digests(paths) if known is not None else sha256_files(paths)
    for fi, digest in zip(manifest.files, digests):
        if digest != fi.sha256:
            raise IntegrityError(f"{fi.path} in {folder} does not match its manifest sha256")


def verify_patched(folder: Path, manifest: WeightsManifest, base: WeightsManifest, patched: dict) -> int:
    """Verify a version rebuilt from the verified version ``base`` by a delta; returns the
    bytes hashed. ``patched`` maps each file to the byte offsets of the blocks the delta
    rewrote (``kiln.shared.weights.delta.patch_delta``: empty for a file copied whole
    from the base; None for a file the delta carried whole).

    A copied chunk is the base's bytes, which matched the base's manifest when the base
    was accepted: it is right exactly when the base's manifest gives it the new
    manifest's digest (a delta applied to the wrong base fails here, or on a patched
    chunk). Patched chunks and carried files are hashed. Files or bases without chunk
    digests are hashed whole."""
    verify_sizes(folder, manifest)
    if set(patched) != {fi.path for fi in manifest.files}:
        raise IntegrityError(
            f"the delta rebuilt {sorted(patched)}, the manifest lists {[f.path for f in manifest.files]}"
        )
    old = {fi.path: fi for fi in base.files}
    hashed = 0
    for fi in manifest.files:
        blocks, b = patched[fi.path], old.get(fi.path)
        if blocks is not None and not blocks and b is not None and b.sha256 == fi.sha256 and b.size == fi.size:
            continue  # copied whole from a base file with the same digest
        chunked = b is not None and fi.chunks and b.chunk == fi.chunk and len(b.chunks) == len(fi.chunks)
        if blocks is None or not chunked:
            hashed += fi.size
            if sha256_file(folder / fi.path) != fi.sha256:
                raise IntegrityError(f"{fi.path} in {folder} does not match its manifest sha256")
            continue
        touched = {off // fi.chunk for off in blocks}
        for i, digest in enumerate(fi.chunks):
            if i not in touched:
                if b.chunks[i] != digest:
                    raise IntegrityError(
                        f"{fi.path} chunk {i} was copied from a base whose digest differs from the manifest's "
                        "(the delta was applied to the wrong base)"
                    )
                continue
            length = min(fi.chunk, fi.size - i * fi.chunk)
            hashed += length
            if sha256_range(folder / fi.path, i * fi.chunk, length) != digest:
                raise IntegrityError(f"{fi.path} chunk {i} in {folder} does not match its manifest sha256")
    return hashed
