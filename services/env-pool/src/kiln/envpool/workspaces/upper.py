"""An environment sandbox's state is its overlay upper directory: what it changed over
its environment's layers. This module turns that state into a portable snapshot and back,
and into a diff against the layers.

Snapshot format: a gzipped tar of the upper directory in the OCI layer convention: a
deleted path is an empty file ``.wh.<name>`` beside where it was, a directory that
replaced a lower one holds an empty ``.wh..wh..opq``. A file of the agent's own whose
name starts with ``.wh.`` is not carried (it would read back as a marker); a marker that
names nothing it could delete is ignored, so no workspace content makes a restore fail. Only regular files, directories
and links inside the tree travel (``tarfile``'s ``data`` filter on restore), so a crafted
archive cannot write outside the new sandbox's upper directory; a snapshot resumes on
any node that has the same environment digest.

Invariant: ``diff`` reads only the upper directory and the layers' files it names, never
the whole repository: its cost follows what the agent changed, not the repository size.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import tarfile
from pathlib import Path, PurePosixPath

from kiln.envpool.workspaces.overlay import (
    OPAQUE_MARKER,
    WHITEOUT_PREFIX,
    copy_upper,
    is_opaque,
    is_whiteout,
    make_opaque,
    make_whiteout,
)
from kiln.envpool.workspaces.trees import SKIP, Changes, record_change
from kiln.envpool.workspaces.walk import Bounds, Tally, walk


def snapshot(upper: Path) -> tuple[bytes, str]:
    """The upper directory as an OCI-convention layer tarball, and its sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for e in walk(upper, Bounds(), []):  # iterative and path-bounded, like the diff
            here, rel = e.here, Path(e.rel)
            if here != upper:
                tar.add(here, arcname=str(rel), recursive=False)
                if is_opaque(here):
                    _empty(tar, rel / OPAQUE_MARKER)
            for name in e.files:  # links to folders included
                if name.startswith(WHITEOUT_PREFIX):
                    continue  # the agent's own file by a marker's name: never read back as a marker
                st = os.lstat(here / name)
                if is_whiteout(st):
                    _empty(tar, rel / f"{WHITEOUT_PREFIX}{name}")
                elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    tar.add(here / name, arcname=str(rel / name), recursive=False)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def _empty(tar: tarfile.TarFile, arcname: Path) -> None:
    info = tarfile.TarInfo(str(arcname))
    info.size = 0
    tar.addfile(info, io.BytesIO(b""))


def restore(data: bytes, sha256: str | None, upper: Path, uid: int, gid: int) -> None:
    """Unpack a ``snapshot`` as ``upper`` (which must not exist), owned by ``uid``."""
    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError("snapshot does not match its sha256")
    staging = upper.with_name(upper.name + ".unpack")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(staging, filter="data")
    for dirpath, _dirs, files in os.walk(staging):
        here = Path(dirpath)
        for name in files:
            if name == OPAQUE_MARKER:
                os.unlink(here / name)
                make_opaque(here)
            elif name.startswith(WHITEOUT_PREFIX):
                os.unlink(here / name)
                target = name[len(WHITEOUT_PREFIX) :]
                if target not in ("", ".", "..") and not os.path.lexists(here / target):
                    make_whiteout(here / target)
    copy_upper(staging, upper, uid, gid)
    shutil.rmtree(staging, ignore_errors=True)


def diff(upper_ws: Path, lowers: list[Path], bounds: Bounds = Bounds()) -> Changes:
    """The changes (``workspace.Changes``: text files, deleted paths, entries not carried:
    binary, too large, links, mode-only changes; folders past the path bounds) of a
    workspace whose writes are ``upper_ws`` over the ``lowers`` workspace folders (topmost
    first), the contract of ``workspace.diff``; walked within ``bounds`` (``walk.py``)."""
    out = Changes()
    tally = Tally(bounds)
    deleted: set[str] = set()
    if not upper_ws.is_dir():
        return out
    for e in walk(upper_ws, bounds, out.omitted):
        here, rel_dir = e.here, PurePosixPath(e.rel)
        if here == upper_ws:
            e.dirs[:] = [d for d in e.dirs if d not in SKIP]
        if here != upper_ws and is_opaque(here):  # replaced a lower directory: its old files are gone
            # (a lower file where the folder now is is gone too; what the folder holds is listed on its own)
            deleted |= {f for f in _lower_files(lowers, rel_dir) if f == e.rel or not os.path.lexists(upper_ws / f)}
        for name in e.files:
            full, rel = here / name, str(rel_dir / name)
            st = os.lstat(full)
            if is_whiteout(st):
                deleted |= set(_lower_files(lowers, rel_dir / name))
                continue
            before = find_lower(lowers, rel)
            if stat.S_ISLNK(st.st_mode):
                if before is None or not before.is_symlink() or os.readlink(before) != os.readlink(full):
                    out.other.append(rel)
                    tally.take()
            elif not stat.S_ISREG(st.st_mode):  # a FIFO, a socket, a device node: listed, never read
                out.other.append(rel)
                tally.take()
            else:
                data = full.read_bytes()
                if before is not None and before.is_file() and not before.is_symlink() and before.read_bytes() == data:
                    if stat.S_IMODE(before.lstat().st_mode) != stat.S_IMODE(st.st_mode):
                        out.other.append(rel)  # a mode change only
                        tally.take()
                    continue  # copied up (opened for writing, touched, chowned) but unchanged
                record_change(rel, data, out.changed, out.other, tally)
            if tally.full:
                break
        if tally.full or len(out.omitted) > bounds.max_files:
            out.truncated = tally.full or f"more than {bounds.max_files} folders past the path bounds"
            break
    out.deleted = sorted(deleted - set(out.changed))
    out.other.sort()
    return out


def find_lower(lowers: list[Path], rel: str) -> Path | None:
    """The file a path shows in the merged lowers (topmost wins; a whiteout hides it)."""
    for layer in lowers:
        p = layer / rel
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            continue
        return None if is_whiteout(st) else p
    return None


def _lower_files(lowers: list[Path], rel: Path) -> list[str]:
    """Every file the lowers show at or under ``rel`` (a file or a directory)."""
    seen: set[str] = set()
    hidden: set[str] = set()
    out: list[str] = []
    for layer in lowers:
        top = layer / rel
        if not (top.exists() or top.is_symlink()):
            continue
        items = [top] if not top.is_dir() or top.is_symlink() else [p for p in top.rglob("*")]
        for p in items:
            r = str(p.relative_to(layer))
            if r in seen or any(r == h or r.startswith(h + "/") for h in hidden):
                continue
            seen.add(r)
            st = os.lstat(p)
            if is_whiteout(st):
                hidden.add(r)
            elif not stat.S_ISDIR(st.st_mode):
                out.append(r)
    return out
