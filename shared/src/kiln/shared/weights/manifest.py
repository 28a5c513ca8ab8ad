"""Manifests of policy versions: what a version holds and how to check a copy of it.

Every file of a version has its size and sha256 in the manifest, every tensor its dtype,
shape and file (read from the safetensors header, no torch needed). ``verify`` is the
gate every receiver passes before it serves a version.

Digests are taken where the bytes are made: the learner hashes the folder it staged
(``file_infos``) and hands the digests over with it; ``build_manifest`` then only checks
that the folder holds exactly those files at those sizes. A version is thus hashed once
at its source and once by each receiver that serves a copy, and a byte that changes
anywhere between the learner's disk and a receiver is caught by that receiver.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kiln.shared.contracts import FileInfo, TensorInfo, WeightsManifest

MANIFEST = "manifest.json"


class IntegrityError(Exception):
    """A stored or received file does not match its manifest."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
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


def file_infos(folder: Path) -> list[FileInfo]:
    """Size and sha256 of every file of a staged version (what its writer hands over)."""
    paths = _staged(folder)
    return [
        FileInfo(path=str(f.relative_to(folder)), size=f.stat().st_size, sha256=digest)
        for f, digest in zip(paths, sha256_files(paths))
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


def verify(folder: Path, manifest: WeightsManifest) -> None:
    for fi in manifest.files:
        f = folder / fi.path
        if not f.is_file():
            raise IntegrityError(f"{fi.path} is missing from {folder}")
        if f.stat().st_size != fi.size:
            raise IntegrityError(f"{fi.path} in {folder} has {f.stat().st_size} bytes, its manifest says {fi.size}")
    digests = sha256_files([folder / fi.path for fi in manifest.files])
    for fi, digest in zip(manifest.files, digests):
        if digest != fi.sha256:
            raise IntegrityError(f"{fi.path} in {folder} does not match its manifest sha256")
