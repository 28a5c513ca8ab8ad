"""Manifests of policy versions: what a version holds and how to check a copy of it.

Every file of a version has its size and sha256 in the manifest, every tensor its dtype,
shape and file (read from the safetensors header, no torch needed). ``verify`` is the
gate every receiver passes before it serves a version.
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


def build_manifest(folder: Path, *, run_id: str, version: int, step: int, parent_version: int | None) -> WeightsManifest:
    files, tensors = [], {}
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    for f, digest in zip(paths, sha256_files(paths)):
        rel = str(f.relative_to(folder))
        files.append(FileInfo(path=rel, size=f.stat().st_size, sha256=digest))
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
