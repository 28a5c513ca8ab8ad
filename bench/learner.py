"""Learner training-step throughput: tokens/s of the tiny MoE preset, by precision and
process count, side by side in one run.

    .venv/bin/python bench/learner.py [--steps 8] [--rows 16] [--seq 256] [--precisions fp32 bf16 mxfp8]

Each cell runs ``--steps`` policy-gradient steps (``kiln.learner.parallel.
policy_gradient_step``: forward, PPO-clip + load-balancing loss, backward, clipping,
AdamW) of the ``configs/tiny.toml`` architecture on a fixed batch of ``--rows``
sequences of ``--seq`` tokens, after one warm-up step, and reports trained tokens (all
positions) per second. 1 process, and 2 processes under torchrun with expert
parallelism (dp_shard 1, ep 2) and with FSDP2 only (dp_shard 2, ep 1), each rank one
thread. Precisions: fp32, bf16 (parameters in bf16), and MXFP8 (torchao, emulated on
CPU) where ``kiln.learner.precision`` is present. Prints a markdown table.

    .venv/bin/python bench/learner.py --memory --shapes 1x1024,1x2048,1x4096,1x8192,8x1024 \
        [--before DIR] [--repeats 3] [--steps 3] [--checkpointing]

Memory mode: the peak memory and time of one fp32 step of the same architecture per
batch shape (``ROWSxTOKENS``, every position a real, trained token, the ``attn`` rows
the learner passes), each measurement in a fresh process, one thread: peak RSS
(``ru_maxrss``) after ``--steps`` steps minus the RSS just before the first (model,
optimizer and batch already built), and the median step time after the first.
``--before DIR`` runs every shape a second time against the kiln source tree in ``DIR``
(e.g. ``git worktree add /tmp/kiln-before <commit>``; its ``shared/src`` and
``services/learner/src`` lead ``PYTHONPATH``), the two trees' runs interleaved,
``--repeats`` rounds; medians, and the spread (min-max) of the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def build(precision: str):
    from kiln.learner.config import LearnerConfig
    from kiln.shared.config import load_config
    from kiln.shared.model import MoEConfig, MoEForCausalLM

    # The architecture fields of the settings (not where a checkpoint would come from).
    arch = load_config(LearnerConfig, ROOT / "configs" / "tiny.toml").model.model_dump(
        exclude={"init_from", "cache_dir"}
    )
    model = MoEForCausalLM(MoEConfig(**arch)).init_weights(0)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    elif precision != "fp32":
        from kiln.learner.precision import apply_precision

        apply_precision(model, precision)
    return model


def batch(rows: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "ids": torch.randint(1, vocab, (rows, seq), generator=g),
        "attn": torch.ones(rows, seq, dtype=torch.long),
        "mask": torch.ones(rows, seq),
        "behaviour": -torch.rand(rows, seq, generator=g) * 6,
        "adv": torch.where(torch.arange(rows)[:, None] % 2 == 0, 1.0, -0.5),
    }


def cell(precision: str, dp: int, ep: int, steps: int, rows: int, seq: int) -> float:
    """Tokens/s (whole batch, all ranks) of ``steps`` steps; runs inside each rank."""
    from kiln.learner.grpo import LossConfig
    from kiln.learner.parallel import ParallelDims, init_distributed, parallelize, policy_gradient_step

    torch.set_num_threads(1)
    model = build(precision)
    world, rank = 1, 0
    if dp * ep > 1:
        meshes = init_distributed(ParallelDims(dp_shard=dp, ep=ep))
        model = parallelize(model, meshes)
        world, rank = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    b = batch(rows, seq, model.config.vocab_size)
    shard = {k: v[rank::world] for k, v in b.items()}
    kw = {
        "global_tokens": float(b["mask"].sum()),
        "loss": LossConfig(clip_eps=0.2),
        "temperature": 1.0,
        "max_grad_norm": 1.0,
    }
    policy_gradient_step(model, opt, shard, **kw)  # warm-up
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        policy_gradient_step(model, opt, shard, **kw)
    if world > 1:
        dist.barrier()
    took = time.perf_counter() - t0
    if world > 1:
        dist.destroy_process_group()
    return rows * seq * steps / took


def memory_cell(rows: int, seq: int, steps: int, checkpointing: bool) -> dict:
    """Peak RSS growth (MiB) over ``steps`` steps and their median time after the first
    (runs in a fresh process: ``ru_maxrss`` is a high-water mark of the whole process)."""
    import resource
    import statistics

    from kiln.learner.grpo import LossConfig
    from kiln.learner.parallel import policy_gradient_step

    torch.set_num_threads(1)
    model = build("fp32")
    model.activation_checkpointing = checkpointing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = batch(rows, seq, model.config.vocab_size)
    kw = {
        "global_tokens": float(b["mask"].sum()),
        "loss": LossConfig(clip_eps=0.2),
        "temperature": 1.0,
        "max_grad_norm": 1.0,
    }
    page = os.sysconf("SC_PAGE_SIZE")
    before = int(Path("/proc/self/statm").read_text().split()[1]) * page  # resident now
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        policy_gradient_step(model, opt, b, **kw)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    import kiln.shared.model.moe as moe

    return {
        "peak_mib": (peak - before) / 2**20,
        "seconds": statistics.median(times[1:] or times),
        "model": moe.__file__,
    }


def memory_table(a) -> None:
    import statistics

    shapes = []
    for spec in a.shapes.split(","):
        rows, seq = (int(x) for x in spec.lower().split("x"))
        shapes.append((rows, seq))
    trees = {"after": None} if not a.before else {"before": Path(a.before).resolve(), "after": None}
    results: dict[tuple[str, int, int], list[dict]] = {}
    for _ in range(a.repeats):  # interleaved: every shape on every tree once per round
        for rows, seq in shapes:
            for name, tree in trees.items():
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                if tree is not None:
                    lead = f"{tree / 'shared' / 'src'}{os.pathsep}{tree / 'services' / 'learner' / 'src'}"
                    env["PYTHONPATH"] = lead + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
                cmd = [sys.executable, __file__, "--steps", str(a.steps), "--memory-cell", str(rows), str(seq)]
                if a.checkpointing:
                    cmd.append("--checkpointing")
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
                if proc.returncode:
                    raise SystemExit(f"{name} {rows}x{seq} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                if tree is not None and not Path(got["model"]).resolve().is_relative_to(tree):
                    raise SystemExit(f"--before {tree}: the model came from {got['model']} (not a kiln source tree?)")
                results.setdefault((name, rows, seq), []).append(got)
    ac = ", activation checkpointing" if a.checkpointing else ""
    print(
        f"tiny preset, fp32, 1 thread{ac}; {a.steps} steps per process, {a.repeats} process(es) per cell; "
        "peak RSS growth over the steps (median, min-max) and median step time\n"
    )
    head = "| rows x tokens | tokens |" + "".join(f" {n} peak MiB | {n} s/step |" for n in trees)
    print(head)
    print("|---|---|" + "---|---|" * len(trees))
    for rows, seq in shapes:
        cells = ""
        for name in trees:
            got = results[name, rows, seq]
            peaks = [r["peak_mib"] for r in got]
            cells += f" {statistics.median(peaks):,.0f} ({min(peaks):,.0f}-{max(peaks):,.0f}) |"
            cells += f" {statistics.median(r['seconds'] for r in got):.2f} |"
        print(f"| {rows} x {seq} | {rows * seq:,} |{cells}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, help="steps per cell (default 8; memory mode 3, the first not timed)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument(
        "--precisions",
        nargs="+",
        choices=["fp32", "bf16", "mxfp8"],
        help="rows to measure (default: every one available)",
    )
    ap.add_argument("--rank-cell", nargs=4, help=argparse.SUPPRESS)  # precision dp ep out (inside torchrun)
    ap.add_argument("--memory", action="store_true", help="peak memory and time per batch shape instead of throughput")
    ap.add_argument("--shapes", default="1x1024,1x2048,1x4096,1x8192,8x1024", help="memory mode: ROWSxTOKENS,...")
    ap.add_argument("--before", help="memory mode: also measure the kiln source tree in this folder (interleaved)")
    ap.add_argument("--repeats", type=int, default=3, help="memory mode: processes per shape and tree")
    ap.add_argument("--checkpointing", action="store_true", help="memory mode: learner.activation_checkpointing on")
    ap.add_argument("--memory-cell", nargs=2, type=int, help=argparse.SUPPRESS)  # rows tokens (a fresh process)
    a = ap.parse_args()
    if a.steps is None:
        a.steps = 3 if a.memory or a.memory_cell else 8
    if a.memory_cell:
        print(json.dumps(memory_cell(*a.memory_cell, a.steps, a.checkpointing)))
        return
    if a.memory:
        memory_table(a)
        return
    if a.rank_cell:
        precision, dp, ep, out = a.rank_cell
        tps = cell(precision, int(dp), int(ep), a.steps, a.rows, a.seq)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(out).write_text(json.dumps(tps))
        return
    precisions = ["fp32", "bf16"]
    try:
        import kiln.learner.precision  # noqa: F401

        precisions.append("mxfp8")
    except ImportError:
        print("(kiln.learner.precision not present: no MXFP8 column)", file=sys.stderr)
    if a.precisions:
        if missing := set(a.precisions) - set(precisions):
            ap.error(f"precision(s) not available here: {', '.join(sorted(missing))}")
        precisions = a.precisions
    layouts = [(1, 1), (1, 2), (2, 1)]
    table = {}
    for precision in precisions:
        for dp, ep in layouts:
            if dp * ep == 1:
                table[precision, dp, ep] = cell(precision, 1, 1, a.steps, a.rows, a.seq)
                continue
            with tempfile.TemporaryDirectory() as d:
                out = Path(d) / "tps.json"
                cmd = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    f"--nproc-per-node={dp * ep}",
                    "--standalone",
                    __file__,
                    "--steps",
                    str(a.steps),
                    "--rows",
                    str(a.rows),
                    "--seq",
                    str(a.seq),
                    "--rank-cell",
                    precision,
                    str(dp),
                    str(ep),
                    str(out),
                ]
                subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
                table[precision, dp, ep] = json.loads(out.read_text())
    print(f"tiny preset, {a.rows} x {a.seq} tokens per step, {a.steps} steps; tokens/s\n")
    print("| precision | 1 process | 2 processes, EP (dp 1, ep 2) | 2 processes, FSDP2 (dp 2, ep 1) |")
    print("|---|---|---|---|")
    for precision in precisions:
        print(f"| {precision} | " + " | ".join(f"{table[precision, dp, ep]:,.0f}" for dp, ep in layouts) + " |")


if __name__ == "__main__":
    main()
