"""The version store and the weight transports against real files, a real nats-server,
PostgreSQL and the real weights service: bit-exact round trips, deltas that ship only
what changed, corruption caught, retention that keeps what kept versions need, the HTTP
API, and a rollout worker that missed versions catching up."""

from __future__ import annotations

import hashlib

import httpx
import pytest
import torch
from harness import InProcessPlatform, experiment, wait_for
from safetensors.torch import load_file
from sqlalchemy import select

from kiln.shared import contracts as c
from kiln.shared.db import Database, PolicyVersion, Run
from kiln.shared.model import MoEConfig, MoEForCausalLM, save_checkpoint
from kiln.shared.model.tokenizer import train_tokenizer
from kiln.shared.weights.manifest import IntegrityError
from kiln.shared.weights.transport.files import FsSource, HttpSource, WeightReceiver
from kiln.shared.weights.verified import VerifiedFiles
from kiln.weights.store import VersionStore

CFG = MoEConfig(
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
)


def checkpoints(tmp_path, n: int, change: float = 1.0, seed: int = 0):
    """``n`` staged versions; each perturbs ``change`` of the tensors of the previous."""
    model = MoEForCausalLM(CFG).init_weights(seed)
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 4, CFG.vocab_size)
    g = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    out = []
    for v in range(n):
        if v:
            k = max(1, round(change * len(params)))
            for i in torch.randperm(len(params), generator=g)[:k].tolist():
                with torch.no_grad():
                    params[i].add_(torch.randn(params[i].shape, generator=g) * 1e-3)
        # the run folder's staging (the ``run_dir`` fixture): the only one the weights service takes
        out.append(save_checkpoint(model, tmp_path / "run" / "staging" / f"v{v}", tokenizer))
    return out


def published(stored, run="r", v=0) -> c.WeightsPublished:
    return c.WeightsPublished(
        run_id=run, version=v, step=v, path=str(stored.path), manifest=stored.manifest, manifest_sha256=stored.digest
    )


def same_files(a, b) -> bool:
    return all((a / f).read_bytes() == (b / f).read_bytes() for f in ("model.safetensors", "config.json"))


@pytest.mark.parametrize("delta", [False, True])
async def test_round_trip_is_bit_exact(tmp_path, delta):
    staged = checkpoints(tmp_path, 4)
    store = VersionStore(tmp_path / "store", delta=delta, keyframe_every=10)
    stored = [
        store.put(s, run_id="r", version=v, step=v, parent_version=v - 1 if v else None) for v, s in enumerate(staged)
    ]
    assert [s.manifest.storage for s in stored] == ["full"] + ["delta" if delta else "full"] * 3
    # two nodes (no shared record): the cold one rebuilds the chain itself
    cold = WeightReceiver(FsSource(tmp_path / "store"), tmp_path / "cache-cold", verified=VerifiedFiles(None))
    warm = WeightReceiver(FsSource(tmp_path / "store"), tmp_path / "cache-warm", verified=VerifiedFiles(None))
    for v, s in enumerate(stored):
        got = await warm.fetch(published(s, v=v))
        assert same_files(got, staged[v]), v
    got = await cold.fetch(published(stored[3], v=3))  # nothing cached: rebuilt from v0 and the deltas
    assert same_files(got, staged[3])
    a, b = load_file(str(got / "model.safetensors")), load_file(str(staged[3] / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)
    again = store.put(staged[3], run_id="r", version=3, step=3, parent_version=2)  # redelivered
    assert again.digest == stored[3].digest


async def test_delta_ships_only_what_changed(tmp_path):
    """100 equal tensors, 2 of them changed: the delta is about 2% of the bytes."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.w": torch.randn(64, 256, generator=g) for i in range(100)}
    folders = []
    for v in range(2):
        if v:
            for i in (17, 63):
                tensors[f"model.layers.{i}.w"] = tensors[f"model.layers.{i}.w"] + 1e-3 * torch.randn(
                    64, 256, generator=g
                )
        d = tmp_path / f"v{v}"
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text('{"model_type": "qwen3_moe"}')
        folders.append(d)
    full = (folders[1] / "model.safetensors").stat().st_size
    store = VersionStore(tmp_path / "store", delta=True, keyframe_every=10)
    store.put(folders[0], run_id="r", version=0, step=0, parent_version=None)
    d = store.put(folders[1], run_id="r", version=1, step=1, parent_version=0)
    shipped = d.manifest.delta.size
    assert 0.005 < shipped / full < 0.03, (shipped, full)  # ~2%: the changed tensors, compressed
    out = await WeightReceiver(FsSource(tmp_path / "store"), tmp_path / "cache").fetch(published(d, v=1))
    assert (out / "model.safetensors").read_bytes() == (folders[1] / "model.safetensors").read_bytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_delta_codes_small_steps_small_and_any_bytes_exactly(tmp_path, dtype):
    """Word differences round-trip every bit pattern (NaNs, infinities, sign flips, wrap
    around), and a step of a few units in the last place costs a fraction of the bytes."""
    from safetensors.torch import save_file

    from kiln.shared.weights.delta import apply_delta, make_delta, word_width

    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        old = torch.randn(64, 1000, generator=g) * 0.02
        new = old + 4e-4 * torch.randn(old.shape, generator=g)  # ~2% of a weight: one Adam step
        old, new = old.to(dtype), new.to(dtype)
        new[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dtype)
        new[1] = -new[1]
    else:
        old = torch.randint(-(2**62), 2**62, (64, 1000), generator=g)
        new = old.clone()
        new[0, 0], new[0, 1] = 2**63 - 1, -(2**63)
    for v, t in (("a", old), ("b", new)):
        (tmp_path / v).mkdir()
        save_file({"w": t, "b": t[:3, :5].clone()}, str(tmp_path / v / "model.safetensors"))
    (tmp_path / "a" / "config.json").write_text("{}")
    (tmp_path / "b" / "config.json").write_text('{"x": 1}')
    f = tmp_path / "b" / "model.safetensors"
    assert word_width(f, f.read_bytes()) == new.element_size()
    blob = make_delta(tmp_path / "a", tmp_path / "b", ["model.safetensors", "config.json"], base_version=0)
    apply_delta(blob, tmp_path / "a", tmp_path / "c")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    if dtype.is_floating_point:  # fewer bytes than the XOR of the same files, compressed alike
        import numpy as np
        import zstandard

        a, b = (np.frombuffer((tmp_path / v / "model.safetensors").read_bytes(), np.uint8) for v in "ab")
        xor = len(zstandard.ZstdCompressor(level=3).compress((a ^ b).tobytes()))
        assert len(blob) < (0.85 if dtype == torch.bfloat16 else 0.95) * xor, (len(blob), xor)


def test_full_versions_are_linked_on_one_filesystem_and_copied_across(tmp_path, monkeypatch):
    import errno
    import os

    staged = checkpoints(tmp_path, 2)
    store = VersionStore(tmp_path / "store", delta=False, keyframe_every=10)
    s0 = store.put(staged[0], run_id="r", version=0, step=0, parent_version=None)
    assert os.stat(s0.path / "model.safetensors").st_ino == os.stat(staged[0] / "model.safetensors").st_ino

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    s1 = store.put(staged[1], run_id="r", version=1, step=1, parent_version=0)
    assert os.stat(s1.path / "model.safetensors").st_ino != os.stat(staged[1] / "model.safetensors").st_ino
    assert same_files(s1.path, staged[1]) and not list(s1.path.parent.glob("*.tmp-*"))


async def test_the_store_takes_the_writers_digests_and_receivers_check_them(tmp_path, monkeypatch):
    """The learner hashes what it staged; the store builds the manifest from those digests
    without hashing again, refuses a folder that does not hold what was listed, and a byte
    changed after the learner hashed is caught by the receiver (linked) or the store
    (copied)."""
    import errno
    import os

    from kiln.shared.weights import manifest as mf

    staged = checkpoints(tmp_path, 3)
    files = [mf.file_infos(s) for s in staged]
    store = VersionStore(tmp_path / "store", delta=False, keyframe_every=10)
    hashed = []
    monkeypatch.setattr(mf, "sha256_files", lambda paths: hashed.extend(paths) or [])
    s0 = store.put(staged[0], run_id="r", version=0, step=0, parent_version=None, files=files[0])
    assert s0.manifest.files == files[0] and not hashed  # nothing hashed by the store
    monkeypatch.undo()
    with pytest.raises(IntegrityError, match="does not hold the files its writer listed"):
        store.put(staged[1], run_id="r", version=1, step=1, parent_version=0, files=files[1][:-1])
    assert store.versions("r") == [0]

    f = staged[1] / "model.safetensors"  # rewritten in place after the learner hashed it
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    s1 = store.put(staged[1], run_id="r", version=1, step=1, parent_version=0, files=files[1])
    with pytest.raises(IntegrityError, match="does not match its manifest sha256"):
        await WeightReceiver(FsSource(tmp_path / "store")).fetch(published(s1, v=1))

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    f = staged[2] / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        store.put(staged[2], run_id="r", version=2, step=2, parent_version=1, files=files[2])
    assert store.versions("r") == [0, 1] and not list((tmp_path / "store" / "r").glob("*.tmp-*"))


async def test_corruption_is_detected_and_refetched(tmp_path):
    staged = checkpoints(tmp_path, 2)
    store = VersionStore(tmp_path / "store", delta=False, keyframe_every=10)
    s0 = store.put(staged[0], run_id="r", version=0, step=0, parent_version=None)
    in_place = WeightReceiver(FsSource(tmp_path / "store"))
    f = s0.path / "model.safetensors"
    good = f.read_bytes()
    f.write_bytes(good[:-10] + b"0123456789")  # bit rot in the store
    with pytest.raises(IntegrityError):
        await in_place.fetch(published(s0))

    class Flaky(FsSource):  # the first download of the weights arrives truncated
        calls = 0

        async def download(self, run_id, version, rel, dest):
            await super().download(run_id, version, rel, dest)
            if rel == "model.safetensors" and Flaky.calls == 0:
                Flaky.calls += 1
                dest.write_bytes(dest.read_bytes()[:1000])

    f.write_bytes(good)
    cached = WeightReceiver(Flaky(tmp_path / "store"), tmp_path / "cache")
    got = await cached.fetch(published(s0))
    assert same_files(got, staged[0]) and Flaky.calls == 1


def test_retention_keeps_chains_and_tags(tmp_path):
    staged = checkpoints(tmp_path, 7)
    store = VersionStore(tmp_path / "store", delta=True, keyframe_every=3)
    for v, s in enumerate(staged):
        store.put(s, run_id="r", version=v, step=v, parent_version=v - 1 if v else None)
    assert [store.manifest("r", v).storage for v in range(7)] == [
        "full",
        "delta",
        "delta",
        "full",
        "delta",
        "delta",
        "full",
    ]
    assert store.chain("r", 5) == [3, 4, 5]
    deleted = store.retain("r", keep_last=2, protected={1})
    # keep 5 and 6 (newest two): 5 needs 3 and 4; tagged 1 needs 0
    assert sorted(deleted) == [2] and store.versions("r") == [0, 1, 3, 4, 5, 6]


async def test_weights_service_publishes_serves_and_retains(nats_server, bus, pg_url, run_dir, tmp_path):
    exp = experiment(
        run_dir,
        nats_server.url,
        pg_url,
        weights={"delta": True, "keyframe_every": 4, "keep_last": 2, "http": {"port": 0, "token": "tok"}},
    )
    p = InProcessPlatform(exp)
    run_id = p.config("weights").run.id
    db = Database(pg_url)
    async with db.session() as s:
        s.add(Run(id=run_id, name="t"))
    staged = checkpoints(tmp_path, 6)
    seen: list[c.WeightsPublished] = []

    async def on(m):
        seen.append(m)

    await bus.watch(c.weights_published_subject(run_id), c.WeightsPublished, on, deliver="all")
    await p.start("weights")
    try:
        for v, folder in enumerate(staged):
            ck = c.PolicyCheckpoint(
                run_id=run_id, version=v, step=v, parent_version=v - 1 if v else None, path=str(folder)
            )
            await bus.publish(c.WEIGHTS_CHECKPOINT, ck, msg_id=f"{run_id}-ckpt-v{v}")
        await wait_for(lambda: len(seen) == 6, 60, 0.1, "six versions published")
        assert [m.version for m in seen] == list(range(6)) and seen[0].url.startswith("http://127.0.0.1:")
        url = seen[-1].url
        async with httpx.AsyncClient(base_url=url) as h:
            assert (await h.get(f"/runs/{run_id}/versions")).status_code == 401
            auth = {"Authorization": "Bearer tok"}
            rows = (await h.get(f"/runs/{run_id}/versions", headers=auth)).json()["versions"]
            assert [r["storage"] for r in rows] == ["full", "delta", "delta", "delta", "full", "delta"]
            # keep_last=2 keeps 4 and 5 (5 needs 4, a full version); 0..3 are gone
            assert [r["version"] for r in rows if not r["deleted"]] == [4, 5]
            m4 = (await h.get(f"/runs/{run_id}/versions/4/manifest", headers=auth)).json()
            size = next(f["size"] for f in m4["files"] if f["path"] == "model.safetensors")
            part = await h.get(
                f"/runs/{run_id}/versions/4/files/model.safetensors", headers={**auth, "Range": "bytes=8-23"}
            )
            assert part.status_code == 206 and part.content == (staged[4] / "model.safetensors").read_bytes()[8:24]
            assert int(part.headers["content-range"].split("/")[1]) == size
            assert (await h.get(f"/runs/{run_id}/versions/4/files/../../etc/passwd", headers=auth)).status_code == 404
            r = await h.post(f"/runs/{run_id}/versions/5/tags", json={"tag": "best"}, headers=auth)
            assert r.json()["tags"] == ["best"]
            assert (await h.put(f"/runs/{run_id}/versions/4/pin", headers=auth)).json()["pinned"] is True

        # a receiver over HTTP, with a cache, rebuilds the newest version from the API
        receiver = WeightReceiver(HttpSource(url, "tok"), tmp_path / "http-cache")
        got = await receiver.fetch(seen[-1])
        assert same_files(got, staged[5])
        full_bytes = sum(f.size for f in seen[-1].manifest.files)
        assert receiver.fetched_bytes < 2 * full_bytes  # v4 whole + a small delta
        await receiver.source.close()
        async with db.session() as s:
            rows = {r.version: r for r in (await s.scalars(select(PolicyVersion))).all()}
        assert (
            rows[0].deleted_at is not None
            and rows[5].deleted_at is None
            and rows[5].stored_bytes < rows[4].stored_bytes
        )
    finally:
        await p.stop_all()
        await db.close()


async def test_rollout_worker_down_for_three_versions_catches_up(nats_server, bus, pg_url, run_dir, tmp_path):
    exp = experiment(run_dir, nats_server.url, pg_url, weights={"delta": True, "keyframe_every": 10})
    p = InProcessPlatform(exp)
    run_id = p.config("weights").run.id
    db = Database(pg_url)
    async with db.session() as s:
        s.add(Run(id=run_id, name="t"))
    await db.close()
    staged = checkpoints(tmp_path, 5)
    await p.start("weights")
    try:
        for v, folder in enumerate(staged[:2]):
            await bus.publish(
                c.WEIGHTS_CHECKPOINT,
                c.PolicyCheckpoint(
                    run_id=run_id, version=v, step=v, parent_version=v - 1 if v else None, path=str(folder)
                ),
            )
        rollout = await p.start("rollout", instance="late-worker")

        async def serving(v):
            h = await bus.request(f"{c.HEALTH_PREFIX}.rollout", c.HealthProbe(), c.HealthReply)
            return h.detail.get("version") == v

        await wait_for(lambda: serving(1), 60, 0.2, "worker serves v1")
        await p.stop(rollout)  # down while three versions go by
        for v in (2, 3, 4):
            await bus.publish(
                c.WEIGHTS_CHECKPOINT,
                c.PolicyCheckpoint(run_id=run_id, version=v, step=v, parent_version=v - 1, path=str(staged[v])),
            )
        await wait_for(
            lambda: (run_dir / "weights" / run_id / "v000004" / "manifest.json").exists(), 30, 0.1, "v4 stored"
        )
        await p.start("rollout", instance="late-worker")
        await wait_for(lambda: serving(4), 60, 0.2, "worker caught up to v4")
        rebuilt = run_dir / "weights-cache" / "late-worker" / run_id / "v000004"
        assert same_files(rebuilt, staged[4])
        assert hashlib.sha256((rebuilt / "model.safetensors").read_bytes()).hexdigest() == next(
            f.sha256
            for f in c.WeightsManifest.model_validate_json(
                (run_dir / "weights" / run_id / "v000004" / "manifest.json").read_text()
            ).files
            if f.path == "model.safetensors"
        )
    finally:
        await p.stop_all()


async def test_a_checkpoint_from_outside_the_staging_folder_is_refused(nats_server, bus, pg_url, run_dir, tmp_path):
    """No message makes the store read or link a path of its choosing: a folder outside the
    staging area, or a staged folder holding a link out of it, goes to the dead-letter
    stream with its reason; nothing is published."""
    p = InProcessPlatform(experiment(run_dir, nats_server.url, pg_url))
    run_id = p.config("weights").run.id
    db = Database(pg_url)
    async with db.session() as s:
        s.add(Run(id=run_id, name="t"))
    await db.close()
    (good,) = checkpoints(tmp_path, 1)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    linking = run_dir / "staging" / "linking"
    linking.mkdir(parents=True)
    (linking / "config.json").write_text("{}")
    (linking / "model.safetensors").symlink_to("/etc/passwd")
    dlq = await bus.js.subscribe(c.dead_letter_subject(c.WEIGHTS_CHECKPOINT))
    await p.start("weights")
    try:
        for v, folder in enumerate([outside, run_dir / "staging" / ".." / ".." / "elsewhere", linking]):
            await bus.publish(
                c.WEIGHTS_CHECKPOINT,
                c.PolicyCheckpoint(run_id=run_id, version=v, step=v, parent_version=None, path=str(folder)),
            )
        reasons = [(await dlq.next_msg(timeout=30)).headers[c.HDR_DLQ_REASON] for _ in range(3)]
        assert sum("is not inside the staging folder" in r for r in reasons) == 2, reasons
        assert any("model.safetensors, which is not a plain file" in r for r in reasons), reasons
        # the real staging folder still works
        await bus.publish(
            c.WEIGHTS_CHECKPOINT,
            c.PolicyCheckpoint(run_id=run_id, version=0, step=0, parent_version=None, path=str(good)),
        )
        await wait_for(
            lambda: (run_dir / "weights" / run_id / "v000000" / "manifest.json").exists(), 60, 0.1, "v0 stored"
        )
        assert not (run_dir / "weights" / run_id / "v000002").exists()
    finally:
        await p.stop_all()
