"""Workspace trees: task templates, clones, snapshots, usage.

Invariants: copies never follow symlinks (a workspace is untrusted: a link to
``/etc/shadow`` stays a link, it is not copied as the file); a snapshot restores only
regular files, directories and links that stay inside the workspace (``tarfile``'s
``data`` filter), so a crafted archive cannot write outside its destination.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from kiln.envpool.workspaces.walk import Bounds, Tally, walk
from kiln.shared.tasks import Task

SKIP = {".tmp"}
"""Per-command scratch that is never part of a workspace's state."""


def materialize(task: Task, dest: Path, prefix: str = "") -> None:
    """Write a task's files under ``dest/prefix`` (the template every sandbox of the task
    copies, or, for a task with an environment, the layer over its repository)."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / prefix).mkdir(parents=True)
    for rel, text in task.files.items():
        f = tmp / prefix / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    os.replace(tmp, dest)


def clone(src: Path, dest: Path) -> None:
    shutil.copytree(
        src, dest, symlinks=True, ignore=lambda d, names: [n for n in names if n in SKIP and Path(d) == src]
    )


def chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            os.chown(os.path.join(dirpath, n), uid, gid, follow_symlinks=False)


def snapshot(root: Path) -> tuple[bytes, str]:
    """A gzipped tar of the workspace (links stored as links) and its sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for entry in sorted(os.listdir(root)):
            if entry not in SKIP:
                tar.add(root / entry, arcname=entry, recursive=True)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def restore(data: bytes, sha256: str | None, dest: Path) -> None:
    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError("snapshot does not match its sha256")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")


MAX_DIFF_FILE = 256 * 1024


@dataclass
class Changes:
    """A workspace's changes as a diff carries them (``WorkspaceDiff``'s fields)."""

    changed: dict[str, str] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    """Changed entries not carried: binary, too large, links, FIFOs, mode-only changes."""
    omitted: list[str] = field(default_factory=list)
    """Folders and files past the walk's path bounds (``walk.py``)."""
    truncated: str = ""


def record_change(rel: str, data: bytes, changed: dict[str, str], other: list[str], tally: Tally | None = None) -> None:
    """A changed file's new bytes: carried as text when small text, else listed in ``other``."""
    if len(data) > MAX_DIFF_FILE:
        other.append(rel)
        if tally is not None:
            tally.take()
        return
    try:
        changed[rel] = data.decode()
    except UnicodeDecodeError:
        other.append(rel)
        data = b""
    if tally is not None:
        tally.take(len(data))


def diff(template: Path, root: Path, bounds: Bounds = Bounds()) -> Changes:
    """The workspace ``root`` against its task's ``template``, walked within ``bounds``
    (``walk.py``): past them the walk stops and ``truncated`` says why."""
    out = Changes()
    tally = Tally(bounds)
    seen = set()
    for e in walk(root, bounds, out.omitted):
        if e.here == root:
            e.dirs[:] = [d for d in e.dirs if d not in SKIP]
        for name in e.files:
            full = e.here / name
            rel = f"{e.rel}/{name}" if e.rel else name
            seen.add(rel)
            before = template / rel
            if full.is_symlink() or not full.is_file():
                out.other.append(rel)
                tally.take()
            else:
                data = full.read_bytes()
                if before.is_file() and not before.is_symlink() and before.read_bytes() == data:
                    if stat.S_IMODE(before.lstat().st_mode) != stat.S_IMODE(full.lstat().st_mode):
                        out.other.append(rel)  # a mode change only
                        tally.take()
                    continue
                record_change(rel, data, out.changed, out.other, tally)
            if tally.full:
                break
        if tally.full or len(out.omitted) > bounds.max_files:
            out.truncated = tally.full or f"more than {bounds.max_files} folders past the path bounds"
            return out
    out.deleted = sorted(
        str(p.relative_to(template))
        for p in template.rglob("*")
        if p.is_file() and str(p.relative_to(template)) not in seen
    )
    out.other.sort()
    return out
