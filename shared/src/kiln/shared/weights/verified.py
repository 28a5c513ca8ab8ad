"""Hash a file once per node: a record of the sha256 a receiver on this node computed for
an inode, shared by every receiver of the node.

N engines on one machine that read a version in place from the shared store read the
same inodes; without this record each hashes every byte of the version (N hashes of the
same bytes on the same cores). With it the first receiver hashes a file and records its
digest under the file's identity, ``<st_dev>-<st_ino>``, with the stamp
``(size, mtime_ns)``; every other receiver that finds a record with the same stamp
takes its digest without reading the file. Receivers that arrive while it hashes wait
on the record's lock (``flock``) instead of hashing too. The learner's own hash of what
it staged (``manifest.file_infos``) is recorded the same way, so on the learner's node
the store's hard links of those files need no receiver to hash them at all.

``NodeBuild`` does the same for versions a receiver keeps in its own cache (a delta
rebuilt, a full version copied): one receiver of the node builds and verifies it, the
others hard-link its files.

Invariants:
- a record holds a digest that was computed from the file's bytes while the file had
  the recorded stamp (the stamp is taken before hashing and checked again after; a file
  that changed meanwhile is not recorded);
- any write to the file through the filesystem after its stamp was taken changes its
  mtime: file times tick coarsely (a few ms), so hashing starts only once the file's
  mtime is ``SETTLE_NS`` old (the learner's fresh files wait that long), and a later
  write lands on a later tick. So a rewritten file, or a recycled inode with new bytes,
  never matches an old record: it is hashed again. (Not ctime: a hard link, such as the
  store's link of a staged file, changes it and not the bytes.) What a record cannot
  see is a change that bypasses the filesystem (bit rot on the disk), or a clock more
  than ``SETTLE_NS`` off this node's stamping the file (a network filesystem's server):
  the same trust a receiver's own ``.verified`` cache folder already has;
- the record folder belongs to this user and no one else may write it (created 0700;
  a folder that is not ours or is open to others is not used: every file is hashed).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("kiln.weights.verified")

SETTLE_NS = 50_000_000
"""How old a file's mtime must be before its hash is recorded (several ticks of the
kernel's coarse file clock)."""
RECORD_TTL_S = 7 * 86400.0
"""Records older than this are dropped by ``prune`` (their inodes are long gone or
re-hashed by then; a record is one small file)."""


def default_root() -> Path:
    """This node's record folder: one per user in the system's temporary folder, which
    every process of the user on the machine shares."""
    return Path(tempfile.gettempdir()) / f"kiln-verified-{os.getuid()}"


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns]


def _settled(path: Path) -> os.stat_result:
    """``path``'s stat once its mtime is ``SETTLE_NS`` old (waiting out the rest)."""
    st = os.stat(path)
    wait = st.st_mtime_ns + SETTLE_NS - time.time_ns()
    if wait > 0:
        time.sleep(wait / 1e9)
        st = os.stat(path)
    return st


def sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class VerifiedFiles:
    """The node's record of hashed inodes (``root=None``: no record, hash every time)."""

    def __init__(self, root: Path | None):
        self.root = self._usable(root) if root is not None else None
        self.hashed = 0
        """Files this process hashed itself (the others came from the record)."""

    @staticmethod
    def _usable(root: Path) -> Path | None:
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.lstat(root)
        except OSError as e:
            log.warning("no shared record of verified files at %s (%s): every receiver hashes", root, e)
            return None
        if not os.path.isdir(root) or os.path.islink(root) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            log.warning("%s is not a private folder of this user: every receiver hashes", root)
            return None
        return root

    def digest(self, path: Path) -> str:
        """The sha256 of ``path``: from the record when it matches the file, else hashed
        (under the record's lock, so a node hashes a file once)."""
        if self.root is None:
            self.hashed += 1
            return sha256_path(path)
        st = os.stat(path)
        if (found := self._read(self._rec(st), _stamp(st))) is not None:
            return found
        return self.hash_and_record(path, sha256_path)

    def hash_and_record(self, path: Path, hasher):
        """``hasher(path)`` (its digest, or a tuple that starts with it), recorded as
        ``path``'s digest unless another receiver already recorded it (then that one)."""
        if self.root is None:
            self.hashed += 1
            return hasher(path)
        st = _settled(path)
        stamp = _stamp(st)
        rec = self._rec(st)
        with open(rec, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
            if hasher is sha256_path and (found := self._read(rec, stamp)) is not None:
                return found  # another receiver hashed it while we waited
            out = hasher(path)
            self.hashed += 1
            if _stamp(os.stat(path)) == stamp:  # unchanged while hashed: the digest is of these bytes
                lock.seek(0)
                lock.truncate()
                lock.write(json.dumps({"stamp": stamp, "sha256": out if isinstance(out, str) else out[0]}))
                lock.flush()
            return out

    def _rec(self, st: os.stat_result) -> Path:
        return self.root / f"{st.st_dev}-{st.st_ino}"

    @staticmethod
    def _read(rec: Path, stamp: list[int]) -> str | None:
        try:
            d = json.loads(rec.read_text())
        except (OSError, ValueError):  # none yet, or being written: take the lock
            return None
        return d["sha256"] if d.get("stamp") == stamp else None

    def digests(self, paths: list[Path]) -> list[str]:
        """``digest`` of several files, on as many threads as cores (hashlib drops the GIL)."""
        if len(paths) <= 1:
            return [self.digest(p) for p in paths]
        with ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1)) as pool:
            return list(pool.map(self.digest, paths))

    def prune(self, ttl_s: float = RECORD_TTL_S) -> None:
        if self.root is None:
            return
        old = time.time() - ttl_s
        for rec in self.root.iterdir():
            try:
                if rec.stat().st_mtime < old:
                    rec.unlink()
            except OSError:
                pass


class NodeBuild:
    """One version made ready once per node: the receivers of a node that each keep a
    cache take turns on the version's lock (``acquire``); the first builds it (copies or
    rebuilds it, verifies it) and ``publish``es its folder with the identity of each file;
    the others hard-link those files into their own caches, and take them only while
    every link is the very inode published, at the size and mtime it had (its files are
    never written again: the receivers' invariant).

    Invariant: a published folder was verified against the manifest named by ``key``
    before it was published (``publish`` is called only after the rename into place)."""

    def __init__(self, verified: VerifiedFiles, key: str):
        self.path = verified.root / f"build-{key}" if verified.root is not None else None
        self._lock = None
        self.found: dict | None = None
        """The published build: ``folder`` and ``files`` (path -> [dev, ino, size, mtime_ns])."""

    def acquire(self) -> None:
        if self.path is None:
            return
        self._lock = open(self.path, "a+")  # noqa: SIM115 (held until release)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self._lock.seek(0)
        try:
            self.found = json.loads(self._lock.read() or "null")
        except ValueError:
            self.found = None

    def link_into(self, tmp: Path) -> bool:
        """Hard-link the published build's files under ``tmp``; False (``tmp`` removed)
        when there is none or it changed."""
        if not self.found:
            return False
        src = Path(self.found["folder"])
        try:
            for rel, ident in self.found["files"].items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                os.link(src / rel, tmp / rel)
                st = os.stat(tmp / rel)
                if [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns] != ident:
                    raise OSError(f"{src / rel} is not the file that was published")
        except OSError as e:
            log.info("not linking the build at %s (%s): building it here", src, e)
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        return True

    def publish(self, folder: Path, rels: list[str]) -> None:
        if self._lock is None:
            return
        files = {}
        for rel in rels:
            st = os.stat(folder / rel)
            files[rel] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(json.dumps({"folder": str(folder), "files": files}))
        self._lock.flush()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None
