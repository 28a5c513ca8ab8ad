"""Delta versions applied sparsely: the receiver's rebuild is bit-identical to the full
version and re-hashes only what it patched, a delta applied to the wrong base is
refused, the store falls back to a full version when the delta would be slower, and a
full version read in place by several receivers of one node is hashed once."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from kiln.shared import contracts as c
from kiln.shared.weights import delta as dl
from kiln.shared.weights.manifest import MANIFEST, IntegrityError, file_infos, verify_patched
from kiln.shared.weights.transport.files import FsSource, WeightReceiver
from kiln.shared.weights.verified import VerifiedFiles
from kiln.weights.store import VersionStore

N = 32  # tensors; 4 shards of 8 tensors of 256 KiB each: 8 MiB a version, 1 MiB chunks


def stage(folder, tensors):
    folder.mkdir(parents=True)
    names = sorted(tensors)
    for i in range(4):
        save_file({k: tensors[k] for k in names[i::4]}, str(folder / f"model-{i + 1:05d}-of-00004.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return folder


def versions(tmp_path, changes: list[list[int]], seed=0):
    """Version 0, then one version per entry of ``changes`` (the tensors it moves)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"model.layers.{i:02d}.w": torch.randn(64 * 1024, generator=g) for i in range(N)}
    out = [stage(tmp_path / f"s{seed}" / "v0", tensors)]
    for v, moved in enumerate(changes, 1):
        for i in moved:
            k = f"model.layers.{i:02d}.w"
            tensors[k] = tensors[k] + 1e-4 * torch.randn(tensors[k].shape, generator=g)
        out.append(stage(tmp_path / f"s{seed}" / f"v{v}", tensors))
    return out


def store_all(tmp_path, staged, name="store"):
    store = VersionStore(tmp_path / name, delta=True, keyframe_every=100)
    return [
        store.put(s, run_id="r", version=v, step=v, parent_version=v - 1 if v else None, files=file_infos(s))
        for v, s in enumerate(staged)
    ]


def published(stored, v) -> c.WeightsPublished:
    return c.WeightsPublished(
        run_id="r", version=v, step=v, path=str(stored.path), manifest=stored.manifest, manifest_sha256=stored.digest
    )


def same(a, b) -> bool:
    names = sorted(p.name for p in b.iterdir())
    return names == sorted(p.name for p in a.iterdir() if p.name not in (MANIFEST, ".verified")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


async def test_a_sparse_delta_rebuilds_the_full_version_bit_for_bit_hashing_only_what_it_patched(tmp_path):
    staged = versions(tmp_path, [[3], [3, 9]])  # one tensor of 32, then two
    stored = store_all(tmp_path, staged)
    assert [s.manifest.storage for s in stored] == ["full", "delta", "delta"]
    rx = WeightReceiver(FsSource(tmp_path / "store"), tmp_path / "cache", verified=VerifiedFiles(None))
    got = []
    for v, s in enumerate(stored):  # checked as it comes: the cache keeps the newest two
        got.append(await rx.fetch(published(s, v)))
        assert same(got[v], staged[v]), v
    assert rx.last["how"] == "delta"
    full = sum(f.size for f in stored[2].manifest.files)
    hashed_by_deltas = rx.hashed_bytes - sum(f.size for f in stored[0].manifest.files)
    assert 0 < hashed_by_deltas <= 3 * 2 * (1 << 20) < full  # the chunks of three moved tensors
    # untouched shards are links to the base's inodes, changed ones new files
    st = {n: (got[1] / n).stat().st_ino == (got[2] / n).stat().st_ino for n in os.listdir(got[2]) if "model" in n}
    assert sorted(st.values()) == [False, False, True, True], st


def test_a_delta_applied_to_the_wrong_base_is_refused(tmp_path):
    """The wrong base is a verified version (its own manifest): the copied chunks'
    digests differ between the manifests, or the patched ones do not hash right."""
    staged = versions(tmp_path, [[3], [5]])
    other = versions(tmp_path, [[3]], seed=1)  # a verified version 1 of other bytes
    good, wrong = staged[1], other[1]
    m = {
        v: c.WeightsManifest(run_id="r", version=v, step=v, parent_version=None, files=file_infos(s), tensors={})
        for v, s in enumerate(staged)
    }
    wrong_m = m[1].model_copy(update={"files": file_infos(wrong)})
    blob = dl.make_delta(good, staged[2], [f.path for f in m[2].files], base_version=1)
    patched = dl.patch_delta(blob, good, tmp_path / "ok")
    verify_patched(tmp_path / "ok", m[2], m[1], patched)  # the right base: accepted
    assert same(tmp_path / "ok", staged[2])
    patched = dl.patch_delta(blob, wrong, tmp_path / "bad")
    with pytest.raises(IntegrityError, match="wrong base|does not match"):
        verify_patched(tmp_path / "bad", m[2], wrong_m, patched)


async def test_a_receiver_holding_a_wrong_base_refetches_from_the_full_chain(tmp_path):
    staged = versions(tmp_path, [[3], [5]])
    other = versions(tmp_path, [[3]], seed=1)
    stored = store_all(tmp_path, staged)
    rx = WeightReceiver(FsSource(tmp_path / "store"), tmp_path / "cache", verified=VerifiedFiles(None))
    await rx.fetch(published(stored[0], 0))
    await rx.fetch(published(stored[1], 1))
    held = tmp_path / "cache" / "r" / "v000001"  # replace its files by another run's version 1
    for f in other[1].iterdir():
        (held / f.name).unlink()
        (held / f.name).write_bytes(f.read_bytes())
    m = json.loads((held / MANIFEST).read_text())
    m["files"] = [json.loads(fi.model_dump_json()) for fi in file_infos(other[1])]
    (held / MANIFEST).write_text(json.dumps(m))
    got = await rx.fetch(published(stored[2], 2))  # refused, then rebuilt from v0 and both deltas
    assert same(got, staged[2])
    assert same(held, staged[1]), "the wrong base was rebuilt on the way"


def test_the_store_falls_back_to_a_full_version_when_the_delta_would_be_slower(tmp_path, monkeypatch):
    # a version that moves every tensor changes ~100% of its bytes: past MAX_CHANGED, stored full
    staged = versions(tmp_path, [[1], list(range(N)), [2]])
    stored = store_all(tmp_path, staged)
    assert [s.manifest.storage for s in stored] == ["full", "delta", "full", "delta"]
    assert 1 / N < dl.MAX_CHANGED < 1  # the one-tensor moves are under it, the all-tensor one over
    # the rule is the fraction: at 1/32 changed, a bound of 1/64 stores full too
    monkeypatch.setattr("kiln.weights.store.MAX_CHANGED", 1 / 64)
    again = store_all(tmp_path, staged, name="store2")
    assert [s.manifest.storage for s in again] == ["full", "full", "full", "full"]
    # and without manifests' digests the comparison stops as soon as the bound is passed
    files = [f.path for f in stored[2].manifest.files]
    assert dl.make_delta(staged[1], staged[2], files, base_version=1, max_changed=dl.MAX_CHANGED) is None
    assert dl.make_delta(staged[2], staged[3], files, base_version=2, max_changed=dl.MAX_CHANGED) is not None


async def test_a_full_version_in_place_is_hashed_once_per_node(tmp_path):
    staged = versions(tmp_path, [[1]])
    store = VersionStore(tmp_path / "store", delta=False, keyframe_every=10)
    stored = [store.put(s, run_id="r", version=v, step=v, parent_version=None) for v, s in enumerate(staged)]
    node = tmp_path / "node"
    receivers = [WeightReceiver(FsSource(tmp_path / "store"), verified=VerifiedFiles(node)) for _ in range(4)]
    for rx in receivers:
        await rx.fetch(published(stored[1], 1))
    assert [rx.verified.hashed for rx in receivers] == [5, 0, 0, 0]  # 4 shards and config.json, once
    f = stored[1].path / "model-00001-of-00004.safetensors"  # rewritten in place: hashed again, and refused
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        await receivers[3].fetch(published(stored[1], 1))
    assert receivers[3].verified.hashed == 1


async def test_receivers_with_caches_on_one_node_build_a_version_once_and_link_it(tmp_path):
    staged = versions(tmp_path, [[3], list(range(N))])  # a delta, then a version stored full
    stored = store_all(tmp_path, staged)
    assert [s.manifest.storage for s in stored] == ["full", "delta", "full"]
    node = tmp_path / "node"
    a, b = (
        WeightReceiver(FsSource(tmp_path / "store"), tmp_path / f"cache-{x}", verified=VerifiedFiles(node))
        for x in "ab"
    )
    for v, s in enumerate(stored):
        got_a = await a.fetch(published(s, v))
        got_b = await b.fetch(published(s, v))
        assert (a.last["how"], b.last["how"]) == (s.manifest.storage, "linked"), v
        assert same(got_b, staged[v])
        for fi in s.manifest.files:
            assert (got_a / fi.path).stat().st_ino == (got_b / fi.path).stat().st_ino
    assert b.hashed_bytes == 0
