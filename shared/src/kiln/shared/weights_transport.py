"""Moving policy versions from the weights store to the engines that serve them.

``WeightTransport`` is the interface (``publish`` on the store side, ``fetch`` on the
receiving side). ``FilesystemTransport`` is the default: versions live in a directory
every receiver can read (a local disk, NFS, a mounted bucket). Invariant of every
transport: ``fetch`` returns a folder only after each file's sha256 matched the
manifest, so a corrupted or partial copy is never served.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from abc import ABC, abstractmethod
from pathlib import Path

from kiln.shared.contracts import FileInfo, TensorInfo, WeightsManifest, WeightsPublished

MANIFEST = "manifest.json"


class IntegrityError(Exception):
    """A stored or received file does not match its manifest."""


class WeightTransport(ABC):
    @abstractmethod
    def publish(self, src: Path, manifest_fields: dict) -> tuple[Path, WeightsManifest, str]:
        """Store the checkpoint folder ``src``; return (stored path, manifest, manifest sha256)."""

    @abstractmethod
    def fetch(self, published: WeightsPublished) -> Path:
        """A local folder holding exactly the published version, verified."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def safetensors_header(path: Path) -> dict:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def build_manifest(folder: Path, *, run_id: str, version: int, step: int, parent_version: int | None) -> WeightsManifest:
    files, tensors = [], {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = str(f.relative_to(folder))
        files.append(FileInfo(path=rel, size=f.stat().st_size, sha256=sha256_file(f)))
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
        if f.stat().st_size != fi.size or sha256_file(f) != fi.sha256:
            raise IntegrityError(f"{fi.path} in {folder} does not match its manifest sha256")


class FilesystemTransport(WeightTransport):
    """Versions as ``<root>/<run_id>/v<version:06d>/`` folders on a shared filesystem."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def version_dir(self, run_id: str, version: int) -> Path:
        return self.root / run_id / f"v{version:06d}"

    def publish(self, src: Path, manifest_fields: dict) -> tuple[Path, WeightsManifest, str]:
        dest = self.version_dir(manifest_fields["run_id"], manifest_fields["version"])
        if (dest / MANIFEST).exists():  # already stored (a redelivered checkpoint)
            manifest = WeightsManifest.model_validate_json((dest / MANIFEST).read_text())
            verify(dest, manifest)
            return dest, manifest, hashlib.sha256((dest / MANIFEST).read_bytes()).hexdigest()
        tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        manifest = build_manifest(tmp, **manifest_fields)
        body = manifest.model_dump_json(by_alias=True, indent=2).encode()
        (tmp / MANIFEST).write_bytes(body)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)  # readers never see a half-written version
        return dest, manifest, hashlib.sha256(body).hexdigest()

    def fetch(self, published: WeightsPublished) -> Path:
        folder = Path(published.path)
        verify(folder, published.manifest)
        return folder
