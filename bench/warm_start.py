"""How the supervised warm start shapes the policy RL starts from (offline, no services).

For each seed: build the policy exactly as the learner does for an experiment file
(tokenizer trained on the suite, MoE initialised from ``run.seed``), run the warm start
(``kiln.learner.sft.warm_start``) in stages, and after each stage run held-out episodes
through the real agent loop (``kiln.rollout.agent.run_episode`` and ``TorchEngine``) with
the two file tools executed in memory as env-pool executes them. A held-out episode
passes when the final workspace equals the task's reference solution (for the
``constants`` family that is exactly "the tests pass").

Reported per stage: SFT loss, greedy pass rate, and the pass rate of samples at
``--temperature`` (what GRPO's groups see: with none passing there is no signal to learn
from), each overall and on the tasks whose target is not the file's first assignment
(those an imperfect demonstrator, ``learner.warm_start.wrong_target_rate``, gets wrong).

    .venv/bin/python bench/warm_start.py --config configs/tiny.toml --seeds 0 1 2 --stages 300 400 500 600 [--stop]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch
from opentelemetry import trace

from kiln.learner.config import LearnerConfig
from kiln.learner.policy import Policy
from kiln.learner.sft import warm_start, wrong_target_edit
from kiln.rollout.agent import run_episode
from kiln.rollout.config import RolloutConfig
from kiln.rollout.engine import TorchEngine
from kiln.rollout.lifecycle import EpisodeSpec
from kiln.shared import contracts as c
from kiln.shared.config import load_config
from kiln.shared.tasks import Task, load_suite


class MemoryTools:
    """``read_file`` and ``edit_file`` on an in-memory workspace, answering as env-pool does."""

    def __init__(self, task: Task):
        self.files = dict(task.files)

    async def create(self, task_id, **_):
        return c.SandboxRef(node_id="memory", sandbox_id=task_id)

    async def tools(self, ref, calls, timeout_s=0.0):
        out = []
        for call in calls:
            a = call.arguments
            try:
                if call.name == "read_file":
                    if a["path"] not in self.files:
                        raise ValueError(f"{a['path']} does not exist")
                    lines = self.files[a["path"]].splitlines(keepends=True)
                    start, end = (a.get("start_line") or 1) - 1, a.get("end_line") or len(lines)
                    result = "".join(lines[start:end])
                elif call.name == "edit_file":
                    text = self.files.get(a["path"])
                    if text is None:
                        raise ValueError(f"{a['path']} does not exist")
                    n = text.count(a["old"]) if a["old"] else 0
                    if n != 1:
                        raise ValueError(
                            f"`old` text not found in {a['path']}" if n == 0 else f"`old` text occurs {n} times"
                        )
                    self.files[a["path"]] = text.replace(a["old"], a["new"], 1)
                    result = f"edited {a['path']}"
                else:
                    raise ValueError(f"tool {call.name} is not simulated")
                out.append(c.ToolResult(call_id=call.id, name=call.name, output=result))
            except ValueError as e:
                out.append(c.ToolResult(call_id=call.id, name=call.name, error=str(e)))
        return out

    async def diff(self, ref):
        return c.WorkspaceDiff()


async def episode(task: Task, engine, tok, rcfg: RolloutConfig, temperature: float, seed: int, tools) -> bool:
    env = MemoryTools(task)
    req = c.RolloutRequest(
        run_id="bench",
        group_id=f"g-{task.id}",
        task_id=task.id,
        n_samples=1,
        dispatch_version=0,
        deadline=time.time() + 600,
    )
    spec = EpisodeSpec(req, 0, task, "bench", seed, temperature, tools=tuple(tools))
    await run_episode(spec, engine, tok, env, rcfg.rollout, trace.get_tracer("bench"))
    return all(env.files.get(p) == text for p, text in (task.solution or {}).items())


async def evaluate(
    model, tok, tasks, rcfg, samples: int, tools, temperature: float = 1.0
) -> tuple[float, float, float, float]:
    """Greedy and sampled pass rates, overall and on the tasks an imperfect demonstrator
    (``learner.warm_start.wrong_target_rate``) gets wrong."""
    engine = TorchEngine(threads=torch.get_num_threads())
    engine.model, engine.version = model.eval(), 0
    greedy = [await episode(t, engine, tok, rcfg, 0.0, 0, tools) for t in tasks]
    sampled = [await episode(t, engine, tok, rcfg, temperature, s, tools) for t in tasks for s in range(samples)]
    model.train()
    lazy = [wrong_target_edit(t) is not None for t in tasks]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return (
        mean(greedy),
        mean(sampled),
        mean([g for g, w in zip(greedy, lazy) if w]),
        mean([p for i, p in enumerate(sampled) if lazy[i // samples]]),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--set", action="append", default=[], help="section.key=value overrides")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--stages", type=int, nargs="+", default=[300, 400, 500, 600], help="cumulative SFT steps at which to evaluate"
    )
    ap.add_argument("--eval-tasks", type=int, default=48, help="held-out tasks evaluated per stage")
    ap.add_argument("--samples", type=int, default=2, help="sampled episodes per task per stage")
    ap.add_argument("--temperature", type=float, default=1.0, help="of the sampled episodes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--stop",
        action="store_true",
        help="end where the run would (learner.warm_start.stop_match) and evaluate there too",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for seed in args.seeds:
        overrides = args.set + [
            f"run.seed={seed}",
            "learner.warm_start.steps=0",
            f"learner.torch_threads={args.threads}",
        ]
        lcfg = load_config(LearnerConfig, args.config, overrides)
        rcfg = load_config(RolloutConfig, args.config, overrides)
        suite = load_suite(lcfg.tasks.suite)
        policy = Policy(lcfg, suite)
        train, heldout = suite.split(lcfg.tasks.split), suite.split(lcfg.eval.split)[: args.eval_tasks]
        t0 = time.monotonic()

        def on_step(done: int, losses: list[float]) -> None:
            nonlocal t0
            if done not in args.stages:
                return
            sft_s = time.monotonic() - t0
            g, s, g2, s2 = asyncio.run(
                evaluate(
                    policy.model, policy.tokenizer, heldout, rcfg, args.samples, lcfg.tasks.tools, args.temperature
                )
            )
            row = dict(
                seed=seed,
                steps=done,
                loss=statistics.mean(losses[-20:]),
                greedy=g,
                sampled=s,
                greedy_second=g2,
                sampled_second=s2,
                sft_s=round(sft_s, 1),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
            t0 = time.monotonic()

        # The very warm start the learner runs (same initial weights, data order and
        # optimizer), evaluated along the way.
        losses = warm_start(
            policy.model,
            policy.tokenizer,
            train,
            steps=max(args.stages),
            lr=lcfg.learner.warm_start.lr,
            batch=lcfg.learner.warm_start.batch,
            seed=seed,
            tools=lcfg.tasks.tools,
            stop_match=lcfg.learner.warm_start.stop_match if args.stop else 0.0,
            wrong_target_rate=lcfg.learner.warm_start.wrong_target_rate,
            prose_fix_rate=lcfg.learner.warm_start.prose_fix_rate,
            on_step=on_step,
        )
        if len(losses) not in args.stages:  # where learner.warm_start.stop_match ended it
            args.stages.append(len(losses))
            on_step(len(losses), losses)
            args.stages.pop()
    print(
        f"| seed | SFT steps | loss (last 20) | held-out greedy | sampled (T = {args.temperature:g}) | greedy, target not first | sampled, target not first |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['seed']} | {r['steps']} | {r['loss']:.3f} | {r['greedy']:.0%} | {r['sampled']:.0%} | {r['greedy_second']:.0%} | {r['sampled_second']:.0%} |"
        )


if __name__ == "__main__":
    main()
