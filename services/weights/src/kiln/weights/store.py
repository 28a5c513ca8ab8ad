"""The version store: every policy version of a run, as full folders or as deltas.

Layout under ``root``::

    <run>/v000004/manifest.json   always
    <run>/v000004/<files>         when the version is stored full
    <run>/v000004/delta.kd        when it is stored as a delta against v000003
    <run>/.base/                  the newest version, whole: the base of the next delta

A version is stored as a delta only when a receiver would rebuild it no slower than it
takes the full version (``kiln.shared.weights.delta.MAX_CHANGED``, for versions of at least
``SMALL_VERSION``); otherwise it is stored full, whatever ``delta`` says.

Invariants: a version directory appears atomically (written under a temporary name,
then renamed), so a reader never sees half a version; a delta version's chain back to
a full version is never broken by retention (a version is kept whenever a kept version
needs it); storing the same version twice stores it once (a redelivered checkpoint).

A full version is hard-linked from the learner's staging folder when both are on one
filesystem (no copy): the learner hands a staged folder over and never rewrites its files
in place (it writes each version to a new folder), so the linked inodes keep the bytes
the manifest describes. Elsewhere the files are copied and the copy verified. The
manifest's digests are the learner's when it sent them (``PolicyCheckpoint.files``):
the store then hashes nothing on the linked path, and every receiver checks the bytes it
serves against what the learner wrote.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kiln.shared.contracts import FileInfo, WeightsManifest
from kiln.shared.weights.delta import MAX_CHANGED, SMALL_VERSION, make_delta
from kiln.shared.weights.manifest import MANIFEST, IntegrityError, build_manifest, verify

DELTA = "delta.kd"


def link_tree(src: Path, dest: Path) -> bool:
    """Hard-link every file of ``src`` under ``dest``; False (and nothing left at
    ``dest``) when the two are on different filesystems or links are refused."""
    try:
        for f in sorted(p for p in src.rglob("*") if p.is_file()):
            target = dest / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(f, target)
    except OSError:
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True, exist_ok=True)
        return False
    return True


@dataclass
class Stored:
    path: Path
    manifest: WeightsManifest
    digest: str
    """sha256 of manifest.json."""


class VersionStore:
    def __init__(self, root: str | os.PathLike, *, delta: bool, keyframe_every: int):
        self.root = Path(root)
        self.delta = delta
        self.keyframe_every = max(1, keyframe_every)

    def version_dir(self, run_id: str, version: int) -> Path:
        return self.root / run_id / f"v{version:06d}"

    def manifest(self, run_id: str, version: int) -> WeightsManifest:
        return WeightsManifest.model_validate_json((self.version_dir(run_id, version) / MANIFEST).read_text())

    def versions(self, run_id: str) -> list[int]:
        d = self.root / run_id
        if not d.is_dir():
            return []
        return sorted(int(p.name[1:]) for p in d.iterdir() if p.name.startswith("v") and (p / MANIFEST).is_file())

    def put(
        self,
        src: Path,
        *,
        run_id: str,
        version: int,
        step: int,
        parent_version: int | None,
        files: list[FileInfo] | None = None,
    ) -> Stored:
        """Store the staged folder ``src`` as ``version``; ``files``: its writer's digests
        (``build_manifest``)."""
        dest = self.version_dir(run_id, version)
        if (dest / MANIFEST).exists():  # already stored (a redelivered checkpoint)
            body = (dest / MANIFEST).read_bytes()
            return Stored(dest, WeightsManifest.model_validate_json(body), hashlib.sha256(body).hexdigest())
        manifest = build_manifest(
            src, run_id=run_id, version=version, step=step, parent_version=parent_version, files=files
        )
        base = self.root / run_id / ".base"
        as_delta = (
            self.delta
            and parent_version is not None
            and version % self.keyframe_every != 0
            and (base / MANIFEST).is_file()
            and self._base_version(base) == parent_version
        )
        tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        blob = None
        if as_delta:  # None when the delta would be slower for receivers than the full version
            blob = make_delta(
                base,
                src,
                [f.path for f in manifest.files],
                base_version=parent_version,
                base_infos=self.manifest_of(base).files,
                new_infos=manifest.files,
                max_changed=MAX_CHANGED if sum(f.size for f in manifest.files) >= SMALL_VERSION else None,
            )
        if blob is not None:
            (tmp / DELTA).write_bytes(blob)
            manifest.storage = "delta"
            manifest.base_version = parent_version
            manifest.delta = FileInfo(path=DELTA, size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
        elif link_tree(src, tmp):
            pass  # the very inodes the writer hashed: receivers check them before serving
        else:
            shutil.copytree(src, tmp, dirs_exist_ok=True)
            try:
                verify(tmp, manifest)  # the copy is what receivers will read
            except IntegrityError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        body = manifest.model_dump_json(by_alias=True, indent=2).encode()
        (tmp / MANIFEST).write_bytes(body)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        if self.delta:
            self._set_base(run_id, src, manifest)
        return Stored(dest, manifest, hashlib.sha256(body).hexdigest())

    @staticmethod
    def manifest_of(folder: Path) -> WeightsManifest:
        return WeightsManifest.model_validate_json((folder / MANIFEST).read_text())

    def _base_version(self, base: Path) -> int:
        return self.manifest_of(base).version

    def _set_base(self, run_id: str, src: Path, manifest: WeightsManifest) -> None:
        base = self.root / run_id / ".base"
        tmp = base.with_name(".base.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if not link_tree(src, tmp):
            shutil.copytree(src, tmp, dirs_exist_ok=True)
        (tmp / MANIFEST).write_text(manifest.model_dump_json(by_alias=True))
        shutil.rmtree(base, ignore_errors=True)
        os.replace(tmp, base)

    def chain(self, run_id: str, version: int) -> list[int]:
        """The versions a receiver needs to rebuild ``version``: the nearest full one at or
        before it, then every delta up to it (oldest first)."""
        out = [version]
        m = self.manifest(run_id, version)
        while m.storage == "delta":
            out.append(m.base_version)
            m = self.manifest(run_id, m.base_version)
        return out[::-1]

    def retain(self, run_id: str, keep_last: int, protected: set[int]) -> list[int]:
        """Delete versions outside the newest ``keep_last`` and ``protected``, keeping every
        version a kept one needs; returns what was deleted."""
        versions = self.versions(run_id)
        wanted = set(versions[-keep_last:]) | (protected & set(versions)) if keep_last > 0 else set(versions)
        needed = set()
        for v in wanted:
            needed.update(self.chain(run_id, v))
        deleted = [v for v in versions if v not in needed]
        for v in deleted:
            shutil.rmtree(self.version_dir(run_id, v), ignore_errors=True)
        return deleted

    def file_path(self, run_id: str, version: int, rel: str) -> Path:
        """A stored file, refusing paths that leave the version's directory."""
        d = self.version_dir(run_id, version).resolve()
        p = (d / rel).resolve()
        if d not in p.parents or not p.is_file():
            raise FileNotFoundError(rel)
        return p

    def size_on_disk(self, run_id: str, version: int) -> int:
        return sum(f.stat().st_size for f in self.version_dir(run_id, version).iterdir() if f.is_file())
