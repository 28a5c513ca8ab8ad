"""Walking a workspace the agent shaped: bounded, whatever it holds.

A sandboxed command can make trees the host cannot walk naively: relative ``mkdir``
after ``cd`` builds paths longer than the host's ``PATH_MAX`` (the workspace's host
prefix makes them longer still), thousands of levels deep (past Python's recursion
limit: ``os.walk`` and ``rglob`` recurse in 3.11), or tens of thousands of files. Every
host-side walk of a workspace (the diff, the quota's usage) goes through ``walk``.

Invariants:
- ``walk`` is iterative (no recursion, whatever the depth) and never descends into a
  folder deeper than ``max_depth`` levels or whose path (relative to the root) is longer
  than ``max_path_chars``; such folders, and files whose path is too long, are listed in
  ``omitted`` instead, so a path it yields always fits the host's ``PATH_MAX``;
- a folder that cannot be listed (gone meanwhile, no permission) is skipped, like
  ``os.walk`` does; nothing the tree holds makes ``walk`` raise;
- ``Tally`` counts what a diff carries; past its bounds ``full`` is set and the walk's
  caller stops, so the cost of a diff is bounded by the bounds, not by the workspace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Bounds:
    max_files: int = 10_000
    """Changed entries one diff carries (text files, others, omitted folders)."""
    max_text_bytes: int = 32 * 1024 * 1024
    """Text one diff carries."""
    max_path_chars: int = 1024
    """Longest path, relative to the workspace, that is walked or written."""
    max_depth: int = 128
    """Deepest folder level walked or written."""

    @classmethod
    def from_settings(cls, s) -> Bounds:
        return cls(s.diff_max_files, s.diff_max_text_bytes, s.max_path_chars, s.max_path_depth)


@dataclass
class Tally:
    """What a diff has taken so far, against its ``Bounds``."""

    bounds: Bounds
    entries: int = 0
    text_bytes: int = 0
    full: str = ""
    """Why the diff stopped (empty: it has not)."""

    def take(self, text_bytes: int = 0) -> bool:
        """Count one entry; False once the diff is past its bounds (``full`` says why)."""
        self.entries += 1
        self.text_bytes += text_bytes
        b = self.bounds
        if not self.full and self.entries > b.max_files:
            self.full = (
                f"the workspace changed more than {b.max_files} files, links and folders (envpool.diff_max_files)"
            )
        elif not self.full and self.text_bytes > b.max_text_bytes:
            self.full = f"the workspace's changed text files hold more than {b.max_text_bytes} bytes (envpool.diff_max_text_bytes)"
        return not self.full


@dataclass
class Entries:
    """One folder of ``walk``: its subfolders (real ones: prune in place to skip them)
    and everything else in it (files, links, links to folders, FIFOs...)."""

    here: Path
    rel: str
    """Relative to the root ("" for the root itself)."""
    dirs: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def walk(root: Path, bounds: Bounds, omitted: list[str]) -> Iterator[Entries]:
    """Top-down, iterative, bounded (module docstring); folders in name order."""
    stack = [(root, "", 0)]
    while stack:
        here, rel, depth = stack.pop()
        entries = Entries(here, rel)
        try:
            with os.scandir(here) as it:
                for e in it:
                    try:
                        is_dir = e.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    (entries.dirs if is_dir else entries.files).append(e.name)
        except OSError:
            continue
        entries.dirs.sort()
        entries.files.sort()
        kept = []
        for name in entries.files:
            child = f"{rel}/{name}" if rel else name
            if len(child) > bounds.max_path_chars:
                omitted.append(child)
            else:
                kept.append(name)
        entries.files = kept
        yield entries
        for name in reversed(entries.dirs):
            child = f"{rel}/{name}" if rel else name
            if depth + 1 >= bounds.max_depth or len(child) > bounds.max_path_chars:
                omitted.append(child)
            else:
                stack.append((here / name, child, depth + 1))


FREE = Bounds(max_files=1 << 62, max_text_bytes=1 << 62)
"""The path bounds alone: for walks that count everything (usage)."""


def usage(root: Path) -> tuple[int, int]:
    """(bytes allocated under ``root``, entries walked). A tree past the path bounds is
    measured whole by ``du`` (which walks any depth), so no depth hides bytes from the
    quota."""
    total = entries = 0
    omitted: list[str] = []
    for e in walk(root, FREE, omitted):
        entries += len(e.dirs) + len(e.files)
        for name in e.files:
            try:
                total += os.lstat(e.here / name).st_blocks * 512
            except OSError:
                pass
    if omitted:
        measured = _du(root)
        if measured is not None:
            return measured, entries + len(omitted)
    return total, entries


def _du(root: Path) -> int | None:
    try:
        out = subprocess.run(["du", "-s", "-B1", "-x", "--", str(root)], capture_output=True, text=True, timeout=120)
        return int(out.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def remove_tree(path: Path) -> None:
    """Delete ``path`` and everything under it, however deep (``shutil.rmtree`` recurses
    in 3.11: a tree past the recursion limit raises); never crosses into another mount."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:
        pass
    if os.path.lexists(path):
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], capture_output=True, timeout=600)
