"""Learner memory and step time against sequence length: chunked logprobs (the learner's
path) against the dense (B, T, V) logits it replaced, on the tiny preset's architecture.

    .venv/bin/python bench/learner_memory.py [--lengths 1024,2048,4096,8192,16384,32768] \
        [--steps 2] [--repeats 1] [--paths chunked,dense] [--trajectory 16384] \
        [--vocab 49152 --dense-max 8192]

Each cell is a fresh process (``ru_maxrss`` is a high-water mark of the whole process,
and torch's CPU allocator is opaque to ``tracemalloc``, which sees Python's allocations
only), one thread, fp32: one row of ``L`` tokens, every position a trained token, through
``kiln.learner.parallel.policy_gradient_step`` (forward, PPO-clip + load-balancing loss,
backward, clipping, AdamW) ``--steps`` times. It reports the peak RSS growth over the
steps (model, optimizer and batch already built, so what the steps add) and the time of
the last step (the first one also builds AdamW's state), and peak MiB per 1,024 tokens:
constant when memory is linear in tokens. ``dense`` swaps the learner's
``sequence_logprobs`` for the pre-chunking one (the whole logits tensor, then
``token_logprobs``) in that process only. ``--vocab`` builds the same architecture with
another vocabulary (e.g. SmolLM2's 49,152: a real vocabulary makes the logits, not the
64-wide layers, the largest per-token term); ``--dense-max`` spares the dense path the
lengths whose logits would not fit.

``--trajectory N``: one ``Policy.train_step`` (the learner's own entry point: the batch
built from a ``Trajectory``, staleness mask, the configured loss) of ``configs/tiny.toml``
(warm start off) on one trajectory of ``N`` tokens: a 512-token prompt, then generated
turns of 3,072 tokens and observations of 512, the last turn cut at ``N``, with the
policy's own logprobs as the behaviour's (computed first, without grad; the peak RSS
growth is counted from before it, and is the step's: that pass's peak is far lower).

Invariants: every cell runs in its own interpreter; the table is printed only from
cells that finished (a failing cell stops the bench with its stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def dense_sequence_logprobs(model, ids, attention_mask, temperature=1.0):
    """The learner's logprobs before chunking: all (B, T, V) logits at once."""
    import torch

    from kiln.shared.model import token_logprobs

    logits, routers = model(ids, attention_mask=attention_mask)
    lp = token_logprobs(logits[:, :-1], ids[:, 1:], temperature)
    return torch.cat((torch.zeros_like(lp[:, :1]), lp), dim=1), routers


def length_cell(length: int, steps: int, path: str, vocab: int = 0) -> dict:
    import torch

    import kiln.learner.parallel as parallel
    from kiln.learner.grpo import LossConfig
    from kiln.shared.model import MoEConfig, MoEForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    from learner import batch, build  # the tiny preset's architecture, fp32

    torch.set_num_threads(1)
    if path == "dense":
        parallel.sequence_logprobs = dense_sequence_logprobs
    model = build("fp32")
    if vocab:  # the same architecture with another vocabulary (the logits' width)
        model = MoEForCausalLM(MoEConfig(**(model.config.model_dump() | {"vocab_size": vocab}))).init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = batch(1, length, model.config.vocab_size)
    kw = {"global_tokens": float(b["mask"].sum()), "loss": LossConfig(), "temperature": 1.0, "max_grad_norm": 1.0}
    before = _rss()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = parallel.policy_gradient_step(model, opt, b, **kw)
        times.append(time.perf_counter() - t0)
    return {"peak_mib": (_peak() - before) / MIB, "seconds": times[-1], "loss": out["loss"]}


def trajectory_cell(length: int) -> dict:
    import random

    import torch

    from kiln.learner.config import LearnerConfig
    from kiln.learner.policy import Policy
    from kiln.shared.config import load_config
    from kiln.shared.contracts import Trajectory, TrajectoryStatus
    from kiln.shared.model import sequence_logprobs
    from kiln.shared.tasks import load_suite

    cfg = load_config(
        LearnerConfig, ROOT / "configs" / "tiny.toml", ["learner.warm_start.steps=0", "learner.torch_threads=1"]
    )
    policy = Policy(cfg, load_suite(cfg.tasks.suite))
    vocab = policy.model.config.vocab_size
    rng = random.Random(0)
    mask: list[int] = [0] * 512
    while len(mask) < length:
        mask += [1] * 3072 + [0] * 512
    mask = mask[:length]
    ids = [rng.randrange(5, vocab) for _ in range(length)]
    torch.set_num_threads(1)
    # Before the no-grad pass: memory it frees stays in the process's heap, so an RSS taken
    # after it would hide part of the step's growth (its own peak is far below the step's).
    before = _rss()
    with torch.no_grad():  # what rollout would have recorded: the policy's own logprobs
        own, _ = sequence_logprobs(
            policy.model, torch.tensor([ids]), torch.ones(1, length, dtype=torch.long), cfg.algorithm.temperature
        )
    traj = Trajectory(
        run_id="bench",
        trajectory_id="t",
        group_id="g",
        task_id="t",
        sample_index=0,
        dispatch_version=0,
        status=TrajectoryStatus.FINISHED,
        token_ids=ids,
        logprobs=[lp if m else 0.0 for lp, m in zip(own[0].tolist(), mask)],
        token_versions=[0 if m else -1 for m in mask],
        loss_mask=mask,
    )
    t0 = time.perf_counter()
    stats = policy.train_step([(traj, 1.0)], version=0)
    took = time.perf_counter() - t0
    return {
        "peak_mib": (_peak() - before) / MIB,
        "seconds": took,
        "tokens": length,
        "trained_tokens": stats.tokens,
        "loss": stats.loss,
        "clip_frac": stats.clip_frac,
        "grad_norm": stats.grad_norm,
    }


def run_cell(args: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"cell {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(lengths: list[int], paths: list[str], steps: int, repeats: int, vocab: int, dense_max: int) -> list[str]:
    import statistics

    got: dict[tuple[str, int], list[dict]] = {}
    for _ in range(repeats):
        for length in lengths:
            for path in paths:
                if path == "dense" and dense_max and length > dense_max:
                    continue
                args = ["--cell", path, str(length), "--steps", str(steps), "--vocab", str(vocab)]
                got.setdefault((path, length), []).append(run_cell(args))
    arch = f"tiny preset with a {vocab:,}-token vocabulary" if vocab else "tiny preset"
    lines = [
        f"{arch}, fp32, 1 thread, one row, every position trained; {steps} steps per process, "
        f"{repeats} process(es) per cell (median); peak RSS growth over the steps and the last step's time",
        "",
        "| tokens |" + "".join(f" {p} peak MiB | {p} MiB per 1k more tokens | {p} s/step |" for p in paths),
        "|---|" + "---|---|---|" * len(paths),
    ]
    previous: dict[str, tuple[int, float]] = {}
    for length in lengths:
        cells = ""
        for path in paths:
            if (path, length) not in got:
                cells += " - | - | - |"
                continue
            peak = statistics.median(r["peak_mib"] for r in got[path, length])
            secs = statistics.median(r["seconds"] for r in got[path, length])
            if path in previous:  # the slope from the previous length: constant when linear
                at, was = previous[path]
                slope = f"{(peak - was) / (length - at) * 1024:.1f}"
            else:
                slope = "-"
            previous[path] = (length, peak)
            cells += f" {peak:,.0f} | {slope} | {secs:.2f} |"
        lines.append(f"| {length:,} |{cells}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768", help="tokens per row, comma-separated")
    ap.add_argument("--paths", default="chunked,dense", help="chunked (the learner's), dense (all logits at once)")
    ap.add_argument("--steps", type=int, default=2, help="steps per process (the last is timed)")
    ap.add_argument("--repeats", type=int, default=1, help="processes per cell")
    ap.add_argument("--vocab", type=int, default=0, help="override the vocabulary size (0: the preset's 2,048)")
    ap.add_argument("--dense-max", type=int, default=0, help="skip the dense path above this many tokens (0: never)")
    ap.add_argument("--trajectory", type=int, default=0, help="also one Policy.train_step on a trajectory of N tokens")
    ap.add_argument("--cell", nargs=2, help=argparse.SUPPRESS)  # path length (a fresh process)
    ap.add_argument("--trajectory-cell", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.cell:
        print(json.dumps(length_cell(int(a.cell[1]), a.steps, a.cell[0], a.vocab)))
        return
    if a.trajectory_cell:
        print(json.dumps(trajectory_cell(a.trajectory_cell)))
        return
    t0 = time.monotonic()
    lengths = [int(x) for x in a.lengths.split(",") if x]
    paths = [p for p in a.paths.split(",") if p]
    if any(p not in ("chunked", "dense") for p in paths):
        raise SystemExit(f"--paths: chunked or dense, not {a.paths!r}")
    lines = table(lengths, paths, a.steps, a.repeats, a.vocab, a.dense_max) if lengths else []
    if a.trajectory:
        r = run_cell(["--trajectory-cell", str(a.trajectory)])
        lines += [
            "",
            f"Policy.train_step on one trajectory of {r['tokens']:,} tokens ({r['trained_tokens']:,} generated): "
            f"peak RSS growth {r['peak_mib']:,.0f} MiB, {r['seconds']:.1f} s, loss {r['loss']:+.4f}, "
            f"clip fraction {r['clip_frac']:.1%}, grad norm {r['grad_norm']:.3f}",
        ]
    lines.append(f"\n({time.monotonic() - t0:.0f} s)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
