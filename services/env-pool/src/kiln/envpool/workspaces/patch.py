"""A workspace's changes as a git-style patch: new, deleted, renamed and binary files and
mode changes, the format ``git apply`` takes and people read.

git computes it (``diff-tree -p --binary -M`` between two trees written into a scratch
repository), from the changed paths only: both sides of every path the workspace diff
names are copied into a scratch folder first, so the cost follows what the agent changed,
never the repository's size.

Invariants: links are copied as links (never followed: a workspace is untrusted); a file
above ``MAX_PATCH_FILE`` stays out of the patch and is listed instead; the scratch
repository runs with no user or system configuration (no hooks, filters or attributes
reach git from outside it); nothing in the workspace makes the diff fail: if git does,
the patch is left out (every path listed), never raised.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("kiln.envpool.workspaces.patch")

MAX_PATCH_FILE = 1 << 20
MAX_PATCH_BYTES = 1 << 20
"""A longer patch is cut (the record says so): it travels inside the trajectory."""


def git_patch(paths: list[str], before: Callable[[str], Path | None], after: Path) -> tuple[str, list[str]]:
    """(patch, paths left out: too large) for ``paths`` between their ``before`` files
    (None: the path did not exist) and the files under ``after``."""
    left_out: list[str] = []
    if not paths:  # nothing changed: no git at all (six processes, ~0.1-0.5 s on a busy node)
        return "", left_out
    with tempfile.TemporaryDirectory(prefix="kiln-patch-") as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        a.mkdir()
        b.mkdir()
        for rel in sorted(set(paths)):
            old, new = before(rel), after / rel
            if any(_too_large(p) for p in (old, new) if p is not None and os.path.lexists(p)):
                left_out.append(rel)
                continue
            if old is not None:
                _copy(old, a / rel)
            if os.path.lexists(new):
                _copy(new, b / rel)
        try:
            out = _diff_trees(Path(tmp), a, b)
        except (subprocess.CalledProcessError, OSError) as e:
            # The workspace's content must never fail its diff (a failed diff would be an
            # infra error, which the learner leaves out): the patch is given up instead.
            detail = (
                e.stderr.decode(errors="replace")[-300:]
                if isinstance(e, subprocess.CalledProcessError) and e.stderr
                else str(e)
            )
            log.warning("git could not make the workspace's patch (%s): left out", detail.strip())
            return "", sorted(set(paths))
    text = out.decode("utf-8", "replace")
    if len(text) > MAX_PATCH_BYTES:
        text = text[:MAX_PATCH_BYTES] + "\n[patch cut at %d bytes]\n" % MAX_PATCH_BYTES
    return text, left_out


def _diff_trees(tmp: Path, a: Path, b: Path) -> bytes:
    env = {
        "GIT_DIR": str(tmp / "git"),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "HOME": str(tmp),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LC_ALL": "C",
    }
    git = ["git", "-c", "core.fileMode=true", "-c", "core.autocrlf=false", "-c", "core.symlinks=true"]
    subprocess.run([*git, "init", "-q"], env=env, check=True, capture_output=True)
    trees = []
    for side, root in (("a", a), ("b", b)):
        side_env = {**env, "GIT_INDEX_FILE": str(tmp / f"index-{side}"), "GIT_WORK_TREE": str(root)}
        subprocess.run([*git, "add", "-A", "--force", "."], env=side_env, cwd=root, check=True, capture_output=True)
        trees.append(
            subprocess.run(
                [*git, "write-tree"], env=side_env, check=True, capture_output=True, text=True
            ).stdout.strip()
        )
    return subprocess.run(
        [*git, "diff-tree", "-r", "-p", "--binary", "-M", "--full-index", *trees],
        env=env,
        check=True,
        capture_output=True,
    ).stdout


def _too_large(p: Path) -> bool:
    st = os.lstat(p)
    return stat.S_ISREG(st.st_mode) and st.st_size > MAX_PATCH_FILE


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode):
        shutil.copyfile(src, dst, follow_symlinks=False)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
