"""Generated tokens per second: a thin harness through the endpoint vs kiln's built-in loop.

    .venv/bin/python bench/harness.py [--episodes 48] [--concurrency 4] [--per-token-ms 4] [--rounds 3]

Both paths run the same built-in tasks with the same engine against a real env-pool
node (its own process, bwrap sandboxes) over a real nats-server:

(a) kiln's built-in loop (``kiln.rollout.agent.run_episode``);
(b) a thin Python harness (``thin_harness`` below: the same loop written against the
    OpenAI API: ask, run the returned ``tool_calls`` with the sandbox's kiln tools, send
    the results back) through the worker's endpoint (``kiln.rollout.harness``: uvicorn,
    the official ``openai`` client, token-faithful stitching), with
    ``run_harness_episode`` around it (sandbox, key, diff).

The engine plays each task's episode as a model would write it (read the file, write the
solution, answer), sleeping ``--per-token-ms`` per generated token as a decoder would:
the endpoint's cost shows against a realistic generation time rather than against
nothing. (a) and (b) alternate ``--rounds`` times after a warm-up; prints the median
tokens/s of each and (b)/(a); every trajectory must pass the same checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from common import envpool_node
from opentelemetry import trace

from kiln.learner.policy import tokenizer_corpus
from kiln.rollout.agent import run_episode
from kiln.rollout.config import HarnessSettings, RolloutSettings
from kiln.rollout.engine import Generation, InferenceEngine
from kiln.rollout.harness.external import run_harness_episode
from kiln.rollout.harness.server import Endpoint
from kiln.rollout.lifecycle import EpisodeSpec
from kiln.shared import chat
from kiln.shared import contracts as c
from kiln.shared.http import serve_http
from kiln.shared.model.tokenizer import train_tokenizer
from kiln.shared.tasks import load_suite
from kiln.shared.tools import tool_schemas

SUITE = load_suite("builtin")
TOOLS = tool_schemas()
TOK = train_tokenizer(tokenizer_corpus(SUITE, 1), 1024)


def call(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


class PlayedEngine(InferenceEngine):
    """Each episode's turns, chosen by the task named in the prompt; a decoder's pace."""

    def __init__(self, per_token_s: float):
        self.version = 0
        self.per_token_s = per_token_s
        self.turn: dict[str, int] = {}

    async def load(self, version, folder):
        self.version = version

    async def abort(self):
        pass

    async def generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
        prompt = TOK.decode(prompt_ids, skip_special_tokens=False)
        task = next(t for t in SUITE.tasks if t.problem_statement[:60] in prompt)
        turns = [
            call("read_file", path=sorted(task.solution)[0]),
            "".join(call("write_file", path=p, content=t) for p, t in sorted(task.solution.items())),
            "Done.",
        ]
        k = prompt.count("<|im_start|>assistant") - 1  # the turns already taken
        ids = TOK.encode(turns[min(k, 2)] + chat.EOS, add_special_tokens=False).ids[:max_new_tokens]
        await asyncio.sleep(self.per_token_s * len(ids))
        self.tokens_generated += len(ids)
        return Generation(ids, [-0.1] * len(ids), self.version, "stop" if ids[-1] in stop_ids else "length")


async def thin_harness(task, client, sandbox):
    msgs = [{"role": "user", "content": task.problem_statement}]
    tools = TOOLS
    for _ in range(4):
        r = await client.chat.completions.create(model="kiln", messages=msgs, tools=tools)
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        if not m.tool_calls:
            return
        calls = [
            c.ToolCall(id=tc.id, name=tc.function.name, arguments=json.loads(tc.function.arguments))
            for tc in m.tool_calls
        ]
        for tc, res in zip(m.tool_calls, await sandbox.tools(calls)):
            msgs.append(
                {
                    "role": "tool",
                    "tool_call_id": tc.id,
                    "content": json.dumps({"error": res.error}) if res.error else res.output,
                }
            )


async def main(episodes: int, concurrency: int, per_token_ms: float, rounds: int) -> None:
    tasks = [t for t in SUITE.tasks if t.solution]
    stop = asyncio.Event()
    async with envpool_node("builtin", tasks[0].id, "harness", max_sandboxes=256) as (_bus, pool):
        engine = PlayedEngine(per_token_ms / 1000)
        settings = RolloutSettings(
            max_turns=4,
            max_new_tokens=256,
            max_total_tokens=8192,
            harness=HarnessSettings(kind="python", entry="__main__:thin_harness"),
        )
        endpoint = Endpoint("kiln", pool)
        url, server = await serve_http(endpoint.app, "127.0.0.1", 0, "", stop)

        def spec(i: int) -> EpisodeSpec:
            task = tasks[i % len(tasks)]
            req = c.RolloutRequest(
                run_id="bench",
                group_id=f"g{i}",
                task_id=task.id,
                n_samples=1,
                dispatch_version=0,
                deadline=time.time() + 600,
            )
            return EpisodeSpec(request=req, sample_index=0, task=task, worker_id="bench", seed=i, temperature=1.0)

        async def builtin(i: int) -> c.Trajectory:
            return await run_episode(spec(i), engine, TOK, pool, settings, trace.get_tracer("bench"))

        async def harness(i: int) -> c.Trajectory:
            return await run_harness_episode(
                spec(i), engine, TOK, pool, settings, endpoint, url, lambda: asyncio.sleep(0)
            )

        async def measure(run) -> tuple[float, int]:
            todo = list(range(episodes))
            tokens = 0
            t0 = time.perf_counter()

            async def worker():
                nonlocal tokens
                while todo:
                    t = await run(todo.pop())
                    assert t.status == c.TrajectoryStatus.FINISHED and t.num_turns == 3, (
                        t.finish_reason,
                        t.infra_error,
                        t.harness_log,
                    )
                    assert t.final_diff.changed == {p: x for p, x in SUITE.get(t.task_id).solution.items()}
                    tokens += sum(t.loss_mask)
                    await pool.destroy(t.sandbox)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return tokens / (time.perf_counter() - t0), tokens

        await measure(builtin)  # warm-up: templates and warm pools of every task
        rates: dict[str, list[float]] = {"a": [], "b": []}
        for _ in range(rounds):  # alternated, so both see the same machine
            for name, path in (("a", builtin), ("b", harness)):
                rate, n = await measure(path)
                rates[name].append(rate)
        n_a = n_b = n
        rate_a, rate_b = statistics.median(rates["a"]), statistics.median(rates["b"])
        await endpoint.close()
        stop.set()
        await server
    print(
        f"| path ({episodes} episodes of 3 turns, {concurrency} at a time, {per_token_ms:g} ms/token) | generated tokens/s (median of {rounds}) | tokens per round |"
    )
    print("|---|---|---|")
    print(f"| (a) kiln's built-in loop | {rate_a:.0f} | {n_a} |")
    print(f"| (b) thin harness through the endpoint | {rate_b:.0f} | {n_b} |")
    print(f"\n(b)/(a) = {rate_b / rate_a:.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--per-token-ms", type=float, default=4.0, help="simulated decode time per generated token")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of (a) and (b); the medians are printed")
    a = ap.parse_args()
    asyncio.run(main(a.episodes, a.concurrency, a.per_token_ms, a.rounds))
