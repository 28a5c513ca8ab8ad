"""Rollout scheduling: ``sync`` vs ``async`` vs ``april`` at equal compute and batch size.

    .venv/bin/python bench/rollout.py [--steps 8] [--groups 4] [--samples 4] [--sigma 1.0] [--set KEY=VALUE ...] [--keep DIR]

Each mode runs the whole platform as ``kiln run`` does (every service a process,
embedded NATS and database, the learner training the ``configs/smoke.toml`` policy, reward
running each task's tests in a sandbox) with the ``sim`` engine: one rollout process
whose decoder fits ``groups x samples`` sequences per step (``max_batch``, the same
compute for every mode) and lognormal generation lengths (median ``--median`` tokens,
sigma ``--sigma``: p99/p50 = exp(2.326 sigma), 10x at 1.0). Batch: ``--groups`` groups of
``--samples`` per step. ``async`` allows one version of staleness, ``april``
over-provisions 2x with ``max_staleness`` 1.

Reported per mode, over steps 2..N (step 1 includes start-up): trajectories trained per
second, learner idle fraction (time waiting for a full batch / wall time), mean and max
staleness of trained trajectories, the fraction of trained tokens sampled by an
older policy than the one each step starts from, and the groups dropped over the whole
run by reason (the learner's ``dropped group <id>: <reason>`` log lines; the reasons are
the controller's: ``stale``, ``infra_error``, ``deadline``, ``run_finished``,
``no_signal``). Prints a markdown table.

``--set`` adds settings to every mode (e.g. ``model.num_hidden_layers=6`` for a learner
whose step takes longer than rollout needs for a batch on these cores: the learner's
idle fraction measures how the schedule overlaps generation with training only when
rollout can keep up at all).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODES = {
    "sync": ["algorithm.mode='sync'", "algorithm.max_staleness=0"],
    "async": ["algorithm.mode='async'", "algorithm.max_staleness=1"],
    "april": ["algorithm.mode='april'", "algorithm.max_staleness=1", "algorithm.overprovision=2.0"],
}


def overrides(args, run_root: Path, mode: str) -> list[str]:
    batch = args.groups * args.samples
    return [
        f"run.root='{run_root}'",
        f"run.id='bench-{mode}'",
        f"algorithm.steps={args.steps}",
        f"algorithm.groups_per_step={args.groups}",
        f"algorithm.samples_per_group={args.samples}",
        "algorithm.group_deadline_s=600",
        "rollout.engine='sim'",
        "rollout.max_turns=1",
        f"rollout.max_new_tokens={args.max_tokens}",
        f"rollout.concurrent_groups={4 * args.groups}",
        f"rollout.sim.length_median={args.median}",
        f"rollout.sim.length_sigma={args.sigma}",
        f"rollout.sim.step_s={args.step_s}",
        f"rollout.sim.max_batch={batch}",
        f"reward.concurrency={batch}",
        "learner.max_dropped_groups=1000",
        "local.replicas={rollout = 1, reward = 1}",
        "telemetry.log_format='text'",
        *MODES[mode],
        *args.set,
    ]


async def run_mode(args, run_root: Path, mode: str) -> dict:
    from kiln.ops.local_run import LocalPlatform

    platform = LocalPlatform(str(ROOT / "configs" / "smoke.toml"), overrides(args, run_root, mode))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = await platform.run()
    if code != 0:
        raise RuntimeError(f"{mode} run failed ({code}):\n{out.getvalue()[-3000:]}")
    steps = sorted(platform.steps, key=lambda m: m.step)
    if len(steps) < 3:
        raise RuntimeError(f"{mode}: only {len(steps)} step metrics arrived")
    window = steps[1:]
    wall = steps[-1].elapsed_seconds - steps[0].elapsed_seconds
    trajs = sum(m.trajectories for m in window)
    gen = sum(m.generated_tokens for m in window)
    return {
        "mode": mode,
        "traj_per_s": trajs / wall,
        "idle": sum(m.wait_seconds for m in window) / wall,
        "mean_staleness": sum(m.mean_staleness * m.trajectories for m in window) / max(1, trajs),
        "max_staleness": max(m.max_staleness for m in window),
        "off_policy": sum(m.off_policy_tokens for m in window) / max(1, gen),
        "dropped": sum(m.dropped_groups for m in steps),
        "drops": drop_reasons(platform.run_dir),
        "step_s": sum(m.step_seconds for m in window) / len(window),
        "wall": wall,
    }


def drop_reasons(run_dir: Path) -> collections.Counter:
    """Groups dropped over the whole run (its end included), by reason, from the learner's log."""
    drops = collections.Counter()
    for log in (run_dir / "logs").glob("learner*.log"):
        drops.update(re.findall(r"dropped group \S+: (\w+)", log.read_text(errors="replace")))
    return drops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--median", type=float, default=40.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--step-s", type=float, default=0.02)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--modes", default="sync,async,april")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for every mode (repeatable)"
    )
    ap.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="keep each mode's run folder (DIR/bench-<mode>) for bench/diagnose_run.py or bench/weights.py --deltas-of-run",
    )
    args = ap.parse_args()
    rows = []
    with contextlib.ExitStack() as stack:
        if args.keep:
            root = args.keep.resolve()
            if taken := [str(root / f"bench-{m}") for m in args.modes.split(",") if (root / f"bench-{m}").exists()]:
                ap.error(f"--keep: run folder(s) already there, never reused: {', '.join(taken)}")
            root.mkdir(parents=True, exist_ok=True)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-bench-rollout-")))
        for mode in args.modes.split(","):
            r = asyncio.run(run_mode(args, root, mode))
            print(f"{mode}: {r}", file=sys.stderr, flush=True)
            rows.append(r)
    if args.keep:
        print(f"\nrun folders kept: {', '.join(str(root / f'bench-{m}') for m in args.modes.split(','))}")
    base = next((r["traj_per_s"] for r in rows if r["mode"] == "sync"), None)
    print(
        f"\nsim engine: lognormal lengths median {args.median:g} tokens, sigma {args.sigma:g}; batch {args.groups} groups x "
        f"{args.samples} samples; decoder {args.groups * args.samples} sequences x {args.step_s * 1000:g} ms/token; "
        f"{args.steps} steps (2..{args.steps} measured){'; ' + ', '.join(args.set) if args.set else ''}\n"
    )
    print(
        "| mode | trajectories/s | vs sync | learner idle | mean staleness | max staleness | off-policy tokens | dropped groups | learner step | dropped by reason (whole run) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rel = f"{r['traj_per_s'] / base:.2f}x" if base else "-"
        print(
            f"| {r['mode']} | {r['traj_per_s']:.2f} | {rel} | {r['idle']:.1%} | {r['mean_staleness']:.2f} | "
            f"{r['max_staleness']} | {r['off_policy']:.1%} | {r['dropped']} | {r['step_s']:.2f} s | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(r['drops'].items())) or 'none'} |"
        )


if __name__ == "__main__":
    main()
