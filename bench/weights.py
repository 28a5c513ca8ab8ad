"""Weight distribution: hand-over to N engines holding a version, against the raw copy.

    .venv/bin/python bench/weights.py [--receivers 1 4 16] [--mb 200] [--rounds 5] [--moved 0.0625]
        [--learner-elsewhere]

One run, on a real nats-server and a real weights service process: the learner's
hand-over (a ``PolicyCheckpoint`` on the bus) of a new version of a model of ``--mb``
MB, until every one of N light receivers (processes running ``WeightReceiver`` on the
``kiln.weights.published`` events, as rollout workers do, without an engine) has it
verified, for full versions read in place from the shared store and for delta versions
rebuilt in each receiver's cache; next to the raw time to copy the same bytes (the
physical floor here). The delta runs are two: every tensor moved (the first table's
delta rows: the store falls back to full versions there, as a delta would rebuild slower,
``kiln.shared.weights.delta.MAX_CHANGED``), and ``--moved`` of the tensors moved (a
sparse update, rebuilt in place). The second table gives, for every delta run, how the
receivers took the versions and how long each took to make one ready (its own clock,
from the event to verified: the rebuild rate per receiver). Each of ``--rounds`` rounds times, in this order, the raw copy of
the round's version, its sha256 and its hand-over (raw, transport, raw, transport...),
so that both see the same machine: the raw copy alone ranged 0.05-0.96 s on this
shared VM, and one sample of it once made a transport look 0.2x or 441x of it. Medians
are reported with their min-max, and the ratio of the medians with the min-max of the
per-round ratios. Version 0 (a full version for every receiver) is handed over first,
untimed. Then the bytes a delta ships for one optimizer step of the smoke preset's
policy from a fresh optimizer, at its learning rate and at fine-tuning ones, in fp32
and bf16. Prints markdown tables (whatever happened: a failed step prints the rows
measured before it; a child still running ``STOP_GRACE_S`` after SIGTERM is killed and
named).

    .venv/bin/python bench/weights.py --deltas-of-run runs/<run> [--every 10]

The realistic update instead: delta bytes between consecutive versions a finished run
stored (e.g. ``make run``'s, the tiny preset), in the dtype it stored and in bf16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import stop_children
from safetensors.torch import save_file

from kiln.ops.embedded import NatsServer
from kiln.shared import contracts as c
from kiln.shared.bus import Bus
from kiln.shared.config import NatsSettings, render_toml
from kiln.shared.db import Database, Run, upgrade
from kiln.shared.weights.manifest import file_infos, sha256_files

RUN = "bench-weights"
LEARNER_RECORD = None
"""Where the bench's learner records its digests (``file_infos``): None, this node's
record, as a learner on the engines' node does; ``--learner-elsewhere``: nowhere, so the
node's receivers hash each version once themselves."""


@dataclass
class Round:
    """One round's timings of one transport and receiver count, in seconds."""

    raw_copy: float
    """``shutil.copytree`` of the round's version folder (then removed, untimed)."""
    sha256: float
    """sha256 of its shards, once (what each receiver does to verify)."""
    hashed: float
    """The learner's ``file_infos`` of it, before the hand-over (the learner's cost)."""
    handover: float
    """From publishing its ``PolicyCheckpoint`` until every receiver holds it, verified."""
    fetch: list[float]
    """Each receiver's own time from the event to the version verified."""
    how: set[str]
    """How the receivers took it (``in place``, ``full``, ``delta``)."""


SHARDS = 4


def model_folder(
    dest: Path, mb: int, seed: int, base: dict | None = None, change: float = 0.0, moved: float = 1.0
) -> dict:
    """A checkpoint-like folder of ``mb`` MB of fp32 tensors (64 tensors in 4 shards, as
    HF checkpoints are sharded); from ``base``, a small update of ``moved`` of the
    tensors (every one, or one in ``1 / moved``, a different set each version)."""
    g = torch.Generator().manual_seed(seed)
    n = mb * 1024 * 1024 // 4 // 64
    if base is None:
        tensors = {f"model.layers.{i}.w": torch.randn(n, generator=g) * 0.02 for i in range(64)}
    else:
        every = max(1, round(1 / moved))
        tensors = {
            k: v + change * torch.randn(v.shape, generator=g) if (i + seed) % every == 0 else v
            for i, (k, v) in enumerate(sorted(base.items()))
        }
    dest.mkdir(parents=True)
    names = sorted(tensors)
    for i in range(SHARDS):
        part = {k: tensors[k] for k in names[i::SHARDS]}
        save_file(part, str(dest / f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"))
    (dest / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return tensors


async def receiver_main(nats_url: str, cache: str, tag: str, run: str) -> None:
    """A light receiver: fetch and verify every published version, report when done."""
    from kiln.shared.weights.transport.files import FsSource, WeightReceiver

    bus = await Bus.connect(NatsSettings(url=nats_url), tag)
    receivers: dict[str, WeightReceiver] = {}

    async def on(m: c.WeightsPublished) -> None:
        root = str(Path(m.path).parents[1])
        if root not in receivers:
            receivers[root] = WeightReceiver(FsSource(root), Path(cache) if cache else None)
        t0 = time.perf_counter()
        await receivers[root].fetch(m)
        how = receivers[root].last.get("how", "?")
        report = {"tag": tag, "how": how, "seconds": time.perf_counter() - t0}
        await bus.nc.publish(f"bench.done.{m.version}", json.dumps(report).encode())

    await bus.watch(c.weights_published_subject(run), c.WeightsPublished, on, deliver="new")
    await bus.nc.publish("bench.ready", tag.encode())
    await asyncio.Event().wait()


async def distribution(
    tmp: Path,
    nats: NatsServer,
    db_url: str,
    n: int,
    delta: bool,
    mb: int,
    rounds: int,
    notes: list[str],
    moved: float = 1.0,
) -> list[Round]:
    """``rounds`` timed rounds of one transport to ``n`` receivers, each version moving
    ``moved`` of the tensors (see the module's docstring); what stopping the children
    needed goes to ``notes``."""
    # One run per measurement: the database remembers which versions a run has stored.
    run = f"{RUN}-{n}-{'delta' if delta else 'full'}-{'all' if moved >= 1 else f'1in{round(1 / moved)}'}"
    async with (db := Database(db_url)).session() as s:
        s.add(Run(id=run, name="bench"))
    await db.close()
    store = tmp / f"store-{n}-{delta}-{moved:g}"
    exp = tmp / f"weights-{n}-{delta}-{moved:g}.toml"
    exp.write_text(
        render_toml(
            {
                "run": {"id": run},
                "nats": {"url": nats.url},
                "database": {"url": db_url},
                "telemetry": {"log_format": "text", "log_level": "WARNING"},
                "weights": {"store_dir": str(store), "staging_dir": str(tmp), "delta": delta, "http": {"port": -1}},
            }
        )
    )
    bus = await Bus.connect(NatsSettings(url=nats.url), "bench")
    await bus.ensure_topology()
    ready, done = asyncio.Queue(), asyncio.Queue()

    async def on_ready(m):
        ready.put_nowait(m.data)

    async def on_done(m):
        done.put_nowait((m.subject, m.data))

    subs = [await bus.nc.subscribe("bench.ready", cb=on_ready), await bus.nc.subscribe("bench.done.*", cb=on_done)]
    weights = subprocess.Popen(
        [sys.executable, "-m", "kiln.weights.main", "--config", str(exp), "--instance", f"w{n}{delta}{moved:g}"]
    )
    receivers = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--receiver",
                nats.url,
                str(tmp / f"cache-{n}-{delta}-{moved:g}-{i}") if delta else "",
                f"r{i}",
                run,
            ]
        )
        for i in range(n)
    ]
    children = {"weights service": weights, **{f"receiver r{i}": p for i, p in enumerate(receivers)}}
    label = f"{n} receivers, {'delta' if delta else 'full'}, {moved:g} moved"

    async def hand_over(v: int, folder: Path, files) -> tuple[float, list[dict]]:
        t0 = time.perf_counter()
        ck = c.PolicyCheckpoint(
            run_id=run, version=v, step=v, parent_version=v - 1 if v else None, path=str(folder), files=files
        )
        await bus.publish(c.WEIGHTS_CHECKPOINT, ck, msg_id=f"{run}-{v}")
        reports = [json.loads((await asyncio.wait_for(done.get(), 600))[1]) for _ in range(n)]
        return time.perf_counter() - t0, reports

    timed = []
    try:
        for _ in range(n):
            await asyncio.wait_for(ready.get(), 120)
        print(f"[bench] {label}: ready", file=sys.stderr, flush=True)
        tensors = model_folder(tmp / f"v0-{n}-{delta}", mb, 0)
        await hand_over(0, tmp / f"v0-{n}-{delta}", file_infos(tmp / f"v0-{n}-{delta}", LEARNER_RECORD))
        for v in range(1, rounds + 1):
            folder = tmp / f"v{v}-{n}-{delta}"
            tensors = model_folder(folder, mb, v, base=tensors, change=1e-4, moved=moved)
            t = time.perf_counter()
            shutil.copytree(folder, tmp / "copy")
            raw = time.perf_counter() - t
            shutil.rmtree(tmp / "copy")
            t = time.perf_counter()
            sha256_files(sorted(folder.glob("*.safetensors")))
            sha = time.perf_counter() - t
            t = time.perf_counter()
            files = file_infos(folder, LEARNER_RECORD)  # as the learner does once it has staged a version
            hashed = time.perf_counter() - t
            took, reports = await hand_over(v, folder, files)
            timed.append(Round(raw, sha, hashed, took, [r["seconds"] for r in reports], {r["how"] for r in reports}))
            shutil.rmtree(tmp / f"v{v - 1}-{n}-{delta}", ignore_errors=True)  # the store has it
            print(f"[bench] {label}: round {v}/{rounds}: {timed[-1]}", file=sys.stderr, flush=True)
        return timed
    finally:
        notes += stop_children(children)
        for sub in subs:
            await sub.unsubscribe()
        await bus.close()
        await asyncio.to_thread(shutil.rmtree, store, True)
        for f in tmp.glob(f"v*-{n}-{delta}"):
            shutil.rmtree(f, ignore_errors=True)


def median_and_range(xs: list[float], digits: int, unit: str = "") -> tuple[str, str]:
    """(median, "min-max") of ``xs`` as table cells."""
    return f"{statistics.median(xs):.{digits}f}{unit}", f"{min(xs):.{digits}f}-{max(xs):.{digits}f}{unit}"


def distribution_row(kind: str, n: int, rs: list[Round]) -> str:
    handover, handover_spread = median_and_range([r.handover for r in rs], 3)
    raw, raw_spread = median_and_range([r.raw_copy for r in rs], 3)
    ratio = statistics.median(r.handover for r in rs) / statistics.median(r.raw_copy for r in rs)
    _, ratios = median_and_range([r.handover / r.raw_copy for r in rs], 1, "x")
    return (
        f"| {kind} | {n} | {len(rs)} | {statistics.median(r.hashed for r in rs):.3f} | {handover} | {handover_spread} "
        f"| {statistics.median(r.handover for r in rs) / n:.3f} | {raw} | {raw_spread} "
        f"| {statistics.median(r.sha256 for r in rs):.3f} | {ratio:.1f}x | {ratios} |"
    )


def rebuild_row(moved: float, mb: int, n: int, rs: list[Round]) -> str:
    """A delta run: how the receivers took its versions, each one's time to make a
    version ready (median and min-max over every receiver of every round), the rate that
    gives per receiver, and the hand-over against the raw copy."""
    fetch = [t for r in rs for t in r.fetch]
    med, spread = median_and_range(fetch, 3)
    how = ", ".join(sorted(set().union(*(r.how for r in rs))))
    handover, raw = statistics.median(r.handover for r in rs), statistics.median(r.raw_copy for r in rs)
    return (
        f"| {'every tensor' if moved >= 1 else f'1 in {round(1 / moved)} tensors'} | {n} | {len(rs)} | {how} "
        f"| {med} | {spread} | {mb * 1e6 / 2**30 / statistics.median(fetch):.2f} | {handover:.3f} | {raw:.3f} "
        f"| {handover / raw:.1f}x |"
    )


def one_step_deltas() -> list[str]:
    """Delta bytes of one optimizer step of the tiny preset (non-zero advantages)."""
    from kiln.learner.config import LearnerConfig
    from kiln.learner.policy import Policy
    from kiln.shared.config import load_config
    from kiln.shared.contracts import Trajectory, TrajectoryStatus
    from kiln.shared.model.checkpoint import to_hf_state_dict
    from kiln.shared.tasks import load_suite

    rows = []
    for lr in (1e-3, 1e-5, 1e-6):
        random.seed(0)
        pol = Policy(load_config(LearnerConfig, "configs/smoke.toml", [f"algorithm.lr={lr}"]), load_suite("builtin"))
        vocab = pol.tokenizer.get_vocab_size()

        def traj(i):
            ids = [random.randrange(vocab) for _ in range(900)]
            return Trajectory(
                run_id="r",
                trajectory_id=f"t{i}",
                group_id="g",
                task_id="t",
                sample_index=i,
                dispatch_version=0,
                status=TrajectoryStatus.FINISHED,
                token_ids=ids,
                logprobs=[0.0] * 700 + [-6.0] * 200,
                token_versions=[-1] * 700 + [0] * 200,
                loss_mask=[0] * 700 + [1] * 200,
            )

        batch = [(traj(i), random.choice([-0.5, 0.5])) for i in range(8)]
        before = {k: v.clone() for k, v in to_hf_state_dict(pol.model).items()}
        pol.train_step(batch)
        rows += delta_rows(f"{lr:g}", before, to_hf_state_dict(pol.model))
    return rows


def delta_rows(label: str, before: dict, after: dict) -> list[str]:
    """Table rows: bytes of the delta from ``before`` to ``after`` (state dicts), stored in
    fp32 and in bf16."""
    from kiln.shared.weights.delta import make_delta

    rows = []
    d = Path(tempfile.mkdtemp(prefix="kiln-bench-delta-"))
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for name, sd in (("a", before), ("b", after)):
                (d / f"{name}{dtype}").mkdir()
                save_file(
                    {k: v.to(dtype).contiguous() for k, v in sd.items()},
                    str(d / f"{name}{dtype}" / "model.safetensors"),
                )
            full = (d / f"b{dtype}" / "model.safetensors").stat().st_size
            blob = make_delta(d / f"a{dtype}", d / f"b{dtype}", ["model.safetensors"], base_version=0)
            rows.append(
                f"| {label} | {str(dtype).removeprefix('torch.')} | {full:,} | {len(blob):,} | {len(blob) / full:.1%} |"
            )
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return rows


def run_deltas(run_dir: Path, every: int) -> list[str]:
    """Delta bytes between consecutive versions a finished run stored (one optimizer step
    each, Adam's state and the learning-rate schedule as the run had them), as stored and
    cast to bf16 (what an engine serving bf16 would be sent)."""
    from safetensors.torch import load_file

    stores = [p for p in (run_dir / "weights").iterdir() if p.is_dir()]
    if len(stores) != 1:
        raise SystemExit(f"expected one run's versions under {run_dir / 'weights'}, found {stores}")
    versions = sorted(int(p.name[1:]) for p in stores[0].glob("v*") if (p / "model.safetensors").is_file())
    rows = []
    for v in versions[1::every]:
        if v - 1 not in versions:
            continue
        a, b = (load_file(str(stores[0] / f"v{u:06d}" / "model.safetensors")) for u in (v - 1, v))
        rows += delta_rows(f"v{v - 1} -> v{v}", a, b)
    return rows


async def main(counts: list[int], mb: int, rounds: int, moved: float) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-weights-"))
    nats = NatsServer(tmp / "nats").start()
    db_url = f"sqlite:///{tmp / 'db.sqlite'}"
    upgrade(db_url)
    rows: list[str] = []
    rebuilt: list[str] = []
    notes: list[str] = []
    try:
        for delta in (False, True):
            for n in counts:
                kind = "delta (rebuilt per receiver)" if delta else "full (shared store, in place)"
                rs = await distribution(tmp, nats, db_url, n, delta, mb, rounds, notes)
                rows.append(distribution_row(kind, n, rs))
                if delta:
                    rebuilt.append(rebuild_row(1.0, mb, n, rs))
        for n in counts:
            rs = await distribution(tmp, nats, db_url, n, True, mb, rounds, notes, moved=moved)
            rebuilt.append(rebuild_row(moved, mb, n, rs))
    finally:
        nats.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        print(
            f"| transport ({mb} MB version) | receivers | rounds | learner hashes (s, median) "
            "| hand-over -> all hold (s, median) | hand-over min-max (s) | per receiver (s) | raw copy (s, median) "
            "| raw copy min-max (s) | sha256 once (s, median) | all hold / raw copy (ratio of medians) | per-round ratios (min-max) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
        print(
            f"\n| delta run ({mb} MB version): tensors moved per version | receivers | rounds | receivers took it as "
            "| per receiver, event -> verified (s, median) | min-max (s) | GB/s per receiver "
            "| hand-over -> all hold (s, median) | raw copy (s, median) | all hold / raw copy |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rebuilt))
        for line in notes:
            print(f"\nstopping: {line}")
        sys.stdout.flush()
    print("\n| lr | dtype | full bytes | delta bytes | delta / full |\n|---|---|---|---|---|")
    print("\n".join(one_step_deltas()))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--receiver":
        asyncio.run(receiver_main(*sys.argv[2:6]))
    else:
        ap = argparse.ArgumentParser()
        ap.add_argument("--receivers", type=int, nargs="+", default=[1, 4, 16])
        ap.add_argument("--mb", type=int, default=200)
        ap.add_argument("--rounds", type=int, default=5, help="timed versions per transport and receiver count")
        ap.add_argument(
            "--learner-elsewhere",
            action="store_true",
            help="the learner's digests are not recorded on this node (a learner on another machine)",
        )
        ap.add_argument(
            "--moved", type=float, default=1 / 16, help="fraction of the tensors the sparse delta run moves"
        )
        ap.add_argument(
            "--deltas-of-run",
            type=Path,
            help="only: delta bytes between consecutive versions of this finished run's folder",
        )
        ap.add_argument("--every", type=int, default=10, help="with --deltas-of-run: one version pair in this many")
        a = ap.parse_args()
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if a.deltas_of_run:
            print("| versions | dtype | full bytes | delta bytes | delta / full |\n|---|---|---|---|---|")
            print("\n".join(run_deltas(a.deltas_of_run, a.every)))
        else:
            if a.learner_elsewhere:
                from kiln.shared.weights.verified import VerifiedFiles

                LEARNER_RECORD = VerifiedFiles(None)
            asyncio.run(main(a.receivers, a.mb, a.rounds, a.moved))
