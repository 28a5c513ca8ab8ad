"""Deltas between two versions of a checkpoint folder: only the bytes that changed.

A delta is computed file by file against the base version: a file identical to the
base's is recorded as ``same``; a file of the same size is cut in fixed blocks and only
the blocks whose bytes differ are kept; anything else is carried whole. The result is
one zstd-compressed blob. Given both manifests (``make_delta``'s ``base_infos`` and
``new_infos``), a file whose digest did not change is not read, and of the others only
the chunks whose digests differ are compared.

A receiver applies a delta sparsely (``patch_delta``): an unchanged file is hard-linked
from the base (or cloned), a changed one cloned from the base (reflink where the
filesystem shares extents, else an in-kernel ``copy_file_range``) and only its changed
blocks read, added to and written back in place (``pwrite``); nothing of the version
is decoded but the changed blocks. ``manifest.verify_patched`` then re-hashes only the
chunks it patched.

Invariants:
- the base a delta is applied to is a verified version: its bytes matched its manifest
  when it was accepted, and the files of a verified version are never written again
  (``patch_delta`` writes only the files it creates in ``dest``). So a block copied from
  the base is the base's verified byte, and a copied chunk is right exactly when both
  manifests give it the same digest; a delta applied to the wrong base is refused on a
  copied chunk whose digests differ, or on a patched chunk that does not hash right;
- ``apply_delta`` (the whole folder, for callers that verify everything themselves) and
  ``patch_delta`` write the same bytes.

When a delta is worth it (``MAX_CHANGED``): a receiver's rebuild costs one copy of the
version (C) plus, for the changed bytes only, the decode, patch and hash (P); taking
the full version instead costs its transfer (at least one copy, C) and one hash of every
byte (H). The delta is no slower when ``C + f * full / P <= C + full / H``, that is
when the changed fraction ``f <= P / H``, for any link (a slower link only makes the
full version dearer). Measured here (2026-12-07, 2 shared cores, 200 MB fp32 versions
with 25% and 100% of their bytes changed): P = 200-220 MB/s of changed bytes (decode,
add, write and hash), H = 1.5-2.4 GB/s (sha256 on one or two cores), so
``f <= 0.08-0.15``; the store takes the low end and stores the version full past it
(versions under ``SMALL_VERSION`` excepted).

A changed block is stored as the difference of its words, modulo 2^(8w), where ``w`` is
the width of the file's tensor elements (4 for fp32, 2 for bf16, read from the
safetensors header; 1 for other files), with each byte position of the words gathered
into its own plane. An optimizer step moves a float by a few units in its last place,
so the difference of two bit patterns read as integers is a small number: its high
byte planes (each plane is one byte position of every changed word of a file) are
almost all zeros and compress to almost nothing, where an XOR of the
same floats flips every bit that a carry crosses; zigzag coding keeps a small negative
difference small too. Measured on consecutive versions of a
``tiny`` run: 51-55% of a full fp32 version against 64-67% with XOR, 18.5-22% against
25-30% in bf16 (docs/benchmarks.md). The arithmetic is on unsigned integers, so any
bytes round-trip exactly whatever they encode.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import zstandard

BLOCK = 4096
"""Bytes per block: small enough that one changed small tensor costs about its own size,
and a multiple of every word width."""
MAX_CHANGED = 0.08
"""Largest fraction of a version's bytes a stored delta may change (changed blocks plus
files carried whole); past it the version is stored full (see the module docstring)."""
SMALL_VERSION = 1 << 20
"""Versions smaller than this are stored as deltas whatever changed: both paths take a
few milliseconds there (a fully changed 1 MiB version rebuilds in ~5 ms at P), and the
compressed delta still ships fewer bytes."""
MAGIC = b"KILNDLT3"
WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
DTYPE_WIDTH = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2}


def word_width(path: Path, data) -> int:
    """The element width of a safetensors file (its bytes, or a uint8 array of them)
    whose tensors all share one (its data then starts on a multiple of 8 bytes, so words
    from byte 0 line up with elements); 1 for anything else."""
    if path.suffix != ".safetensors" or len(data) < 8:
        return 1
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except ValueError:
        return 1
    widths = {DTYPE_WIDTH.get(v.get("dtype"), 1) for k, v in header.items() if k != "__metadata__"}
    w = widths.pop() if len(widths) == 1 else 1
    return w if (8 + n) % w == 0 else 1


def _read_at(f, offset: int, length: int) -> np.ndarray:
    """``length`` bytes of the open file ``f`` from ``offset`` (fewer at its end), zero
    padded to whole blocks (read in place, no extra copy)."""
    buf = np.zeros(-(-length // BLOCK) * BLOCK, np.uint8)
    view, done = memoryview(buf), 0
    while done < length:  # one read returns at most ~2 GiB on Linux
        n = os.preadv(f.fileno(), [view[done:length]], offset + done)
        if not n:
            break
        done += n
    return buf


def _words(buf: np.ndarray, w: int) -> np.ndarray:
    return buf.view(WORDS[w]).reshape(-1, BLOCK // w)


def _encode(diff: np.ndarray, w: int) -> bytes:
    """Zigzag (a difference of -1 becomes 1, not all ones), then one plane per byte
    position of the words: the low bytes of every changed word, then the next, ...
    ``diff`` is overwritten."""
    s = diff.view(SIGNED[w])
    sign = s >> (8 * w - 1)
    s <<= 1
    s ^= sign
    return np.ascontiguousarray(diff.view(np.uint8).reshape(-1, w).T).tobytes()


def _decode(raw: bytes, w: int, blocks: int) -> np.ndarray:
    n = blocks * BLOCK // w
    planes = np.frombuffer(raw, np.uint8, count=n * w).reshape(w, n)
    z = np.ascontiguousarray(planes.T).view(WORDS[w]).reshape(-1)
    sign = z & 1
    np.negative(sign, out=sign)  # 0 or all ones, modulo 2^(8w)
    z >>= 1
    z ^= sign
    return z.reshape(blocks, BLOCK // w)


def _changed(a: np.ndarray, b: np.ndarray, changed: np.ndarray) -> np.ndarray:
    """``b - a`` (modulo 2^(8w)) over the changed blocks; no gather when all changed."""
    if len(changed) == len(a):
        return b - a
    return b[changed] - a[changed]


SCAN = 64 << 20
"""Bytes compared at a time when no chunk digests say where to look."""


class NotWorthIt(Exception):
    """More bytes changed than ``make_delta``'s ``max_changed`` allows."""


def _diff_file(old: Path, new: Path, size: int, w: int, skip: set[int], unit: int, budget: list[int]):
    """(changed block indices, their word differences) of two files of ``size`` bytes,
    comparing ``unit`` bytes at a time and skipping the units listed in ``skip`` (their
    digests are equal); ``budget[0]`` (bytes still allowed to change) is spent as
    changed blocks are found, and ``NotWorthIt`` raised once it is overdrawn."""
    blocks, diffs = [], []
    with old.open("rb", buffering=0) as fa, new.open("rb", buffering=0) as fb:
        for u in range(-(-size // unit)):
            if u in skip:
                continue
            off, length = u * unit, min(unit, size - u * unit)
            a_buf, b_buf = _read_at(fa, off, length), _read_at(fb, off, length)
            changed = np.flatnonzero((a_buf.view(np.uint64) != b_buf.view(np.uint64)).reshape(-1, BLOCK // 8).any(1))
            if not len(changed):
                continue
            budget[0] -= len(changed) * BLOCK
            if budget[0] < 0:
                raise NotWorthIt
            blocks.append(changed + off // BLOCK)
            diffs.append(_changed(_words(a_buf, w), _words(b_buf, w), changed))  # wraps modulo 2^(8w)
    return blocks, diffs


def make_delta(
    base: Path,
    new: Path,
    files: list[str],
    *,
    base_version: int,
    level: int = 3,
    base_infos: list | None = None,
    new_infos: list | None = None,
    max_changed: float | None = None,
) -> bytes | None:
    """The delta from ``base`` to ``new`` over ``files``. ``base_infos``/``new_infos``:
    both versions' ``FileInfo``s (their manifests): a file with equal digests is not read
    at all, and of the others only the chunks whose digests differ. ``max_changed``: the
    most the delta may change, as a fraction of the version's bytes (changed blocks plus
    files carried whole); past it, None (and the comparison stops there: the caller
    stores the version full, see ``delta_pays``)."""
    old_by = {fi.path: fi for fi in base_infos or []}
    new_by = {fi.path: fi for fi in new_infos or []}
    sizes = {rel: (new / rel).stat().st_size for rel in files}
    budget = [int(max_changed * sum(sizes.values())) if max_changed is not None else 1 << 62]
    header: dict = {"base_version": base_version, "block": BLOCK, "files": {}}
    payload: list[bytes] = []
    try:
        for rel in files:
            size = sizes[rel]
            old_path = base / rel
            if not old_path.is_file() or old_path.stat().st_size != size or size == 0:
                budget[0] -= size
                if budget[0] < 0:
                    raise NotWorthIt
                header["files"][rel] = {"mode": "full", "size": size}
                payload.append((new / rel).read_bytes())
                continue
            fo, fn = old_by.get(rel), new_by.get(rel)
            if fo is not None and fn is not None and fo.size == fn.size == size and fo.sha256 == fn.sha256:
                header["files"][rel] = {"mode": "same"}
                continue
            with (new / rel).open("rb", buffering=0) as f:
                head = _read_at(f, 0, min(size, 1 << 20))
            w = word_width(new / rel, head[: min(size, 1 << 20)])
            comparable = fo is not None and fn is not None and fo.chunks and fo.chunk == fn.chunk
            comparable = comparable and len(fo.chunks) == len(fn.chunks)
            unit = fn.chunk if comparable else SCAN
            skip = {i for i, (x, y) in enumerate(zip(fo.chunks, fn.chunks)) if x == y} if comparable else set()
            blocks, diffs = _diff_file(old_path, new / rel, size, w, skip, unit, budget)
            if not blocks:
                header["files"][rel] = {"mode": "same"}
                continue
            changed = np.concatenate(blocks)
            header["files"][rel] = {"mode": "diff", "word": w, "size": size, "blocks": changed.tolist()}
            payload.append(_encode(np.concatenate(diffs) if len(diffs) > 1 else diffs[0], w))
    except NotWorthIt:
        return None
    head = json.dumps(header, separators=(",", ":")).encode()
    raw = MAGIC + struct.pack("<Q", len(head)) + head + b"".join(payload)
    return zstandard.ZstdCompressor(level=level, threads=-1).compress(raw)


def _open(delta: bytes) -> tuple[dict, memoryview, int]:
    raw = zstandard.ZstdDecompressor().decompress(delta, max_output_size=1 << 40)
    if raw[:8] != MAGIC:
        raise ValueError(f"not a kiln delta of this format (magic {raw[:8]!r}, expected {MAGIC!r})")
    (n,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + n])
    if header["block"] != BLOCK:
        raise ValueError(f"delta blocks of {header['block']} bytes, this reader uses {BLOCK}")
    return header, memoryview(raw), 16 + n


FICLONE = 0x40049409
"""ioctl that shares a file's extents with a new file (btrfs, XFS, bcachefs, ...)."""


def clone_file(src: Path, dst: Path) -> None:
    """Copy ``src`` to the new file ``dst`` as cheaply as the filesystem allows: shared
    extents (reflink) where it has them, else an in-kernel copy (``copy_file_range``:
    no trip through user space; server-side on NFS), else large plain reads and writes."""
    size = src.stat().st_size
    with src.open("rb") as fi, dst.open("wb") as fo:
        try:
            fcntl.ioctl(fo.fileno(), FICLONE, fi.fileno())
            return
        except OSError:
            pass
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), min(size - done, 1 << 30), done, done)
                if n == 0:
                    raise ValueError(f"{src} changed size while it was copied")
                done += n
            return
        except OSError:  # not supported here (old kernel, some filesystems): copy by hand
            fi.seek(done)
            fo.seek(done)
        shutil.copyfileobj(fi, fo, 16 << 20)


def _link_or_clone(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        clone_file(src, dst)


def _runs(blocks: np.ndarray) -> list[tuple[int, int, int]]:
    """(first block, index into ``blocks``, count) of each run of consecutive blocks."""
    cut = np.flatnonzero(np.diff(blocks) != 1) + 1
    starts = np.concatenate(([0], cut))
    counts = np.diff(np.concatenate((starts, [len(blocks)])))
    return [(int(blocks[i]), int(i), int(k)) for i, k in zip(starts, counts)]


def _patch(fd: int, size: int, blocks: np.ndarray, diff: np.ndarray, w: int) -> None:
    """Add ``diff`` (one row per changed block) to those blocks of the open file ``fd``,
    read and written in place, run by run of consecutive blocks."""
    for first, i, k in _runs(blocks):
        off = first * BLOCK
        length = min(k * BLOCK, size - off)
        buf = np.zeros(k * BLOCK, np.uint8)  # the last block of a file may be short: zero pad
        if os.preadv(fd, [memoryview(buf)[:length]], off) != length:
            raise ValueError("a base file changed size while it was patched")
        words = buf.view(WORDS[w]).reshape(k, BLOCK // w)
        words += diff[i : i + k]  # wraps modulo 2^(8w)
        if os.pwrite(fd, memoryview(buf)[:length], off) != length:
            raise OSError("short write while patching")


def patch_delta(delta: bytes, base: Path, dest: Path) -> dict[str, list[int] | None]:
    """Write the new version's files into ``dest`` from ``base`` sparsely: a file the
    delta marks unchanged is linked (or cloned), a changed one cloned from the base and
    only its changed blocks rewritten in place (``pwrite``), a new one written whole.
    Returns, per file, the byte offsets of the blocks rewritten (empty: the base's file
    as is; None: carried whole), which is what ``manifest.verify_patched`` re-hashes.
    Only files created here are written: the base's files are never opened for writing."""
    header, view, pos = _open(delta)
    dest.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[int] | None] = {}
    for rel, spec in header["files"].items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if spec["mode"] == "same":
            _link_or_clone(base / rel, target)
            out[rel] = []
        elif spec["mode"] == "full":
            target.write_bytes(view[pos : pos + spec["size"]])
            pos += spec["size"]
            out[rel] = None
        else:
            size, w = spec["size"], spec["word"]
            blocks = np.asarray(spec["blocks"], np.int64)
            if (base / rel).stat().st_size != size:
                raise ValueError(f"{rel}: base has {(base / rel).stat().st_size} bytes, the delta expects {size}")
            clone_file(base / rel, target)
            if len(blocks):
                diff = _decode(view[pos : pos + len(blocks) * BLOCK], w, len(blocks))
                fd = os.open(target, os.O_RDWR)
                try:
                    _patch(fd, size, blocks, diff, w)
                finally:
                    os.close(fd)
            pos += len(blocks) * BLOCK
            out[rel] = (blocks * BLOCK).tolist()
    return out


def apply_delta(delta: bytes, base: Path, dest: Path) -> list[str]:
    """Write the new version's files into ``dest`` (``patch_delta``); returns their
    relative paths. The caller verifies them against the new version's manifest."""
    return list(patch_delta(delta, base, dest))


def base_version(delta: bytes) -> int:
    raw = zstandard.ZstdDecompressor().decompressobj().decompress(delta[:65536])
    (n,) = struct.unpack("<Q", raw[8:16])
    return json.loads(raw[16 : 16 + n])["base_version"]
