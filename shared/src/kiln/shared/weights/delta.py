"""Deltas between two versions of a checkpoint folder: only the bytes that changed.

A delta is computed file by file against the base version: a file identical to the
base's is recorded as ``same``; a file of the same size is cut in fixed blocks and only
the blocks whose bytes differ are kept, XORed with the base's (an XOR of two close
floating-point values is mostly zero bits, which compresses well); anything else is
carried whole. The result is one zstd-compressed blob. ``apply_delta`` rebuilds the new
files from the base folder; callers verify every rebuilt file against the new
version's manifest before using it, so a delta applied to the wrong base is caught.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import zstandard

BLOCK = 4096
"""Bytes per block: small enough that one changed small tensor costs about its own size."""
MAGIC = b"KILNDLT1"


def make_delta(base: Path, new: Path, files: list[str], *, base_version: int, level: int = 3) -> bytes:
    header: dict = {"base_version": base_version, "block": BLOCK, "files": {}}
    payload: list[bytes] = []
    for rel in files:
        data = (new / rel).read_bytes()
        old_path = base / rel
        old = old_path.read_bytes() if old_path.is_file() else None
        if old == data:
            header["files"][rel] = {"mode": "same"}
        elif old is not None and len(old) == len(data) and len(data) > 0:
            a = np.frombuffer(old, dtype=np.uint8)
            b = np.frombuffer(data, dtype=np.uint8)
            pad = (-len(data)) % BLOCK
            xa = np.concatenate([a, np.zeros(pad, np.uint8)]).reshape(-1, BLOCK)
            xb = np.concatenate([b, np.zeros(pad, np.uint8)]).reshape(-1, BLOCK)
            x = xa ^ xb
            changed = np.flatnonzero(x.any(axis=1))
            header["files"][rel] = {"mode": "xor", "size": len(data), "blocks": changed.tolist()}
            payload.append(x[changed].tobytes())
        else:
            header["files"][rel] = {"mode": "full", "size": len(data)}
            payload.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    raw = MAGIC + struct.pack("<Q", len(head)) + head + b"".join(payload)
    return zstandard.ZstdCompressor(level=level).compress(raw)


def apply_delta(delta: bytes, base: Path, dest: Path) -> list[str]:
    """Write the new version's files into ``dest``; returns their relative paths."""
    raw = zstandard.ZstdDecompressor().decompress(delta, max_output_size=1 << 40)
    if raw[:8] != MAGIC:
        raise ValueError("not a kiln delta")
    (n,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + n])
    block = header["block"]
    pos = 16 + n
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for rel, spec in header["files"].items():
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if spec["mode"] == "same":
            out.write_bytes((base / rel).read_bytes())
        elif spec["mode"] == "full":
            out.write_bytes(raw[pos : pos + spec["size"]])
            pos += spec["size"]
        else:
            size, blocks = spec["size"], spec["blocks"]
            old = np.frombuffer((base / rel).read_bytes(), dtype=np.uint8)
            if len(old) != size:
                raise ValueError(f"{rel}: base has {len(old)} bytes, the delta expects {size}")
            pad = (-size) % block
            buf = np.concatenate([old, np.zeros(pad, np.uint8)]).reshape(-1, block)
            x = np.frombuffer(raw[pos : pos + len(blocks) * block], dtype=np.uint8).reshape(-1, block)
            pos += len(blocks) * block
            if blocks:
                buf[blocks] ^= x
            out.write_bytes(buf.reshape(-1)[:size].tobytes())
        written.append(rel)
    return written


def base_version(delta: bytes) -> int:
    raw = zstandard.ZstdDecompressor().decompressobj().decompress(delta[:65536])
    (n,) = struct.unpack("<Q", raw[8:16])
    return json.loads(raw[16 : 16 + n])["base_version"]
