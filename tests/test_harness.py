"""External harnesses through the rollout endpoint: the official ``openai`` client against
the real FastAPI app served by uvicorn, a scripted engine (its tokens known), and a real
env-pool over a real nats-server for the external harnesses and the exec bridge.

What must hold: every trained token is one the engine generated, with the logprob and
version it reported; a harness that keeps its history extends one trajectory, one that
rewrites it splits it with the reason; suspensions stay inside a call; budgets, bad
requests and foreign keys get OpenAI-style errors; a crashing or hanging harness ends
with its reason and leaves no sandbox."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import openai
import pytest
from test_agent import TASK, TOK, ScriptedEngine, request, tool_call

from kiln.rollout.config import HarnessSettings, RolloutSettings
from kiln.rollout.engine import Generation
from kiln.rollout.episode import Budget, Episode
from kiln.rollout.harness.external import run_harness_episode
from kiln.rollout.harness.server import Endpoint
from kiln.rollout.lifecycle import EpisodeSpec
from kiln.shared import chat
from kiln.shared import contracts as c
from kiln.shared.http import serve_http
from kiln.shared.toolformats import FORMATS, tool_format

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_terminal_cmd",
            "description": "run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


class Scripted(ScriptedEngine):
    """Plays back fixed turns; every token gets a distinct logprob and the version served.
    ``abort_first``: the first generation stops halfway with ``abort`` (a new version
    coming), as the worker's APRIL abort makes a real engine do."""

    def __init__(self, turns: list[str], version: int = 3, abort_first: bool = False):
        super().__init__(turns, version)
        self.abort_first = abort_first
        self.generated: list[tuple[list[int], list[float], list[int]]] = []
        self.pending: list[int] = []

    async def generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.pending or TOK.encode(self.turns.pop(0) + chat.EOS, add_special_tokens=False).ids
        self.pending = []
        finish = "stop"
        if self.abort_first:
            self.abort_first = False
            ids, self.pending, finish = ids[: len(ids) // 2], ids[len(ids) // 2 :], "abort"
        elif len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        lps = [-(len(self.generated) + 1) * 0.01 - k * 1e-4 for k in range(len(ids))]
        self.generated.append((ids, lps, [self.version] * len(ids)))
        return Generation(ids, lps, self.version, finish)


def trained(traj_or_seq) -> list[tuple[int, float, int]]:
    s = traj_or_seq
    return [(t, lp, v) for t, lp, v, m in zip(s.ids, s.logprobs, s.versions, s.mask) if m]


@pytest.fixture
async def endpoint():
    """The endpoint on loopback, with a factory of episodes registered on it."""
    stop = asyncio.Event()
    ep = Endpoint("kiln-test", envpool=None)
    url, task = await serve_http(ep.app, "127.0.0.1", 0, "", stop)

    def new(engine, *, max_tokens=10_000, calls=50, deadline=None, wait_resume=None, fmt="hermes"):
        budget = Budget(max_tokens, calls, deadline or time.time() + 600, 256)
        e = Episode(
            "e1",
            engine,
            TOK,
            tool_format(fmt),
            budget,
            seed=1,
            temperature=1.0,
            wait_resume=wait_resume or (lambda: asyncio.sleep(0)),
        )
        key = ep.register(e, c.SandboxRef(node_id="n", sandbox_id="sb"))
        return e, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

    yield new, url
    stop.set()
    await task


async def test_openai_client_tools_stream_samples_and_exact_tokens(endpoint):
    new, _ = endpoint
    engine = Scripted(
        [
            "Let me run it." + tool_call("run_terminal_cmd", command="python -m pytest"),
            "Fixed.",
            "Also fixed.",
            "Done, both ways.",
        ]
    )
    ep, client = new(engine)
    assert [m.id for m in (await client.models.list()).data] == ["kiln-test"]
    msgs = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "fix calc.py"}]
    r = await client.chat.completions.create(model="kiln-test", messages=msgs, tools=TOOLS)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me run it."
    (call,) = choice.message.tool_calls
    assert call.function.name == "run_terminal_cmd" and json.loads(call.function.arguments) == {
        "command": "python -m pytest"
    }
    assert r.usage.completion_tokens == len(engine.generated[0][0])
    # The harness keeps the answer, adds the tool's result, asks for two samples, streamed.
    msgs += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "1 failed"},
    ]
    stream = await client.chat.completions.create(model="kiln-test", messages=msgs, tools=TOOLS, n=2, stream=True)
    texts: dict[int, str] = {}
    finishes = {}
    async for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == {0: "Fixed.", 1: "Also fixed."} and finishes == {0: "stop", 1: "stop"}
    # It keeps the second sample and goes on: the trajectory follows the kept one.
    msgs += [{"role": "assistant", "content": "Also fixed."}, {"role": "user", "content": "sure?"}]
    r = await client.chat.completions.create(model="kiln-test", messages=msgs, tools=TOOLS)
    assert r.choices[0].message.content == "Done, both ways."
    ep.finish()
    assert not ep.segments and all(call.extended for call in ep.calls[1:])
    # Every trained token is one the engine generated, with its logprob and version; the
    # sample the harness dropped is not trained.
    first, _, second, third = engine.generated
    expected = [x for ids, lps, vs in (first, second, third) for x in zip(ids, lps, vs)]
    assert trained(ep.seq) == expected
    # The context between them is exactly what the engine was prompted with.
    assert engine.prompts[-1] == ep.seq.ids[: len(engine.prompts[-1])]


async def test_a_harness_that_rewrites_history_splits_the_trajectory(endpoint):
    new, _ = endpoint
    engine = Scripted(["First answer.", "Second answer.", "Third.", "Fourth."])
    ep, client = new(engine)
    msgs = [{"role": "user", "content": "task"}]
    a = (await client.chat.completions.create(model="m", messages=msgs)).choices[0].message.content
    msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": "more"}]
    await client.chat.completions.create(model="m", messages=msgs)
    # A summarising harness replaces the history.
    summary = [{"role": "user", "content": "task (summary: we answered twice)"}]
    c3 = (await client.chat.completions.create(model="m", messages=summary)).choices[0].message.content
    # ...and goes on from the summary: that call extends the new segment, it opens no other.
    summary += [{"role": "assistant", "content": c3}, {"role": "user", "content": "go on"}]
    await client.chat.completions.create(model="m", messages=summary)
    ep.finish()
    (seg,) = ep.segments
    assert "does not extend" in seg.reason and "rewrote" in seg.reason
    assert [call.extended for call in ep.calls] == [False, True, False, True]
    assert engine.prompts[-1] == ep.seq.ids[seg.start : seg.start + len(engine.prompts[-1])]
    traj = c.Trajectory(
        run_id="r",
        trajectory_id="t",
        group_id="g",
        task_id="x",
        sample_index=0,
        dispatch_version=0,
        status=c.TrajectoryStatus.FINISHED,
        token_ids=ep.seq.ids,
        logprobs=ep.seq.logprobs,
        token_versions=ep.seq.versions,
        loss_mask=ep.seq.mask,
        segments=ep.segments,
    )
    before, after = traj.sequences()
    assert after.start == seg.start and traj.token_ids[after][: len(engine.prompts[2])] == engine.prompts[2]
    # Each generated token trained once: the second answer (never kept) closes the first segment.
    assert trained(ep.seq) == [x for g in engine.generated for x in zip(*g)]


async def test_suspension_stays_inside_the_call(endpoint):
    new, _ = endpoint
    engine = Scripted(["A long answer that a new version interrupts."], version=3, abort_first=True)

    async def resume():  # the worker loads the next version, then the call goes on
        await engine.load(4, None)

    ep, client = new(engine, wait_resume=resume)
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
    assert (
        r.choices[0].message.content == "A long answer that a new version interrupts."
        and r.choices[0].finish_reason == "stop"
    )
    ep.finish()
    versions = [v for _, _, v in trained(ep.seq)]
    assert versions[0] == 3 and versions[-1] == 4 and sorted(versions) == versions


async def test_budgets_bad_requests_and_foreign_keys(endpoint):
    new, url = endpoint
    engine = Scripted(["one two three four five six seven eight", "never"])
    ep, client = new(engine, max_tokens=4)
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
    assert e.value.code == "budget_exhausted"
    _, other = new(Scripted(["x"]))
    with pytest.raises(openai.BadRequestError) as e:
        await other.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], top_p=0.5)
    assert e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError):
        await other.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.BadRequestError):
        await other.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    stranger = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="kiln-ep-guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await stranger.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert len(ep.calls) == 1  # nothing the refused calls sent reached the episode


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tool_formats_round_trip(name):
    fmt = FORMATS[name]
    calls = [("run_terminal_cmd", {"command": "ls -la"}), ("edit_file", {"path": "a.py", "old": "x", "new": "y"})]
    tools = TOOLS + [
        {
            "type": "function",
            "function": {
                "name": "edit_file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
                },
            },
        }
    ]
    prose, parsed = fmt.parse(fmt.render(calls), tools)
    assert [(p.name, p.arguments) for p in parsed] == calls and not any(p.error for p in parsed)
    assert fmt.instructions(tools) and not fmt.instructions([])
    _, bad = fmt.parse(
        {
            "hermes": "<tool_call>{oops</tool_call>",
            "qwen3_coder": "<tool_call><function=x>",
            "llama3_json": '{"name": "x", "parameters": [1]}',
        }[name]
    )
    assert bad and bad[0].error


# --- the runners, against a real env-pool -----------------------------------------


async def fix_with_the_client(task, client, sandbox):
    """A Python harness: asks the model, runs what it says in the sandbox, fixes the bug."""
    msgs = [{"role": "user", "content": task.problem_statement}]
    r = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    call = r.choices[0].message.tool_calls[0]
    out = await sandbox.exec(json.loads(call.function.arguments)["command"], 30)
    await sandbox.exec("sed -i 's/a - b/a + b/' calc.py", 30)
    msgs += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": out.stdout},
    ]
    await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)


async def crash(task, client, sandbox):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    raise RuntimeError("the harness fell over")


def spec(deadline_s: float = 60) -> EpisodeSpec:
    return EpisodeSpec(
        request=request(deadline=time.time() + deadline_s),
        sample_index=0,
        task=TASK,
        worker_id="w",
        seed=1,
        temperature=1.0,
    )


async def run(envpool, engine, harness: HarnessSettings, deadline_s: float = 60, **settings) -> c.Trajectory:
    stop = asyncio.Event()
    ep = Endpoint("m", envpool)
    url, task = await serve_http(ep.app, "127.0.0.1", 0, "", stop)
    try:
        return await run_harness_episode(
            spec(deadline_s),
            engine,
            TOK,
            envpool,
            RolloutSettings(harness=harness, **settings),
            ep,
            url,
            lambda: asyncio.sleep(0),
        )
    finally:
        await ep.close()
        stop.set()
        await task
        assert not ep.bindings  # the key is revoked whatever happened


async def test_python_harness_runs_in_the_sandbox_and_records_its_episode(envpool):
    engine = Scripted(["I will look." + tool_call("run_terminal_cmd", command="cat calc.py"), "Fixed."])
    t = await run(envpool, engine, HarnessSettings(kind="python", entry="test_harness:fix_with_the_client"))
    assert t.status == c.TrajectoryStatus.FINISHED and t.finish_reason == "harness_done" and t.num_turns == 2, (
        t.harness_log
    )
    assert t.final_diff.changed == {"calc.py": "def add(a, b):\n    return a + b\n"}
    assert [(x, lp, v) for x, lp, v, m in zip(t.token_ids, t.logprobs, t.token_versions, t.loss_mask) if m] == [
        x for g in engine.generated for x in zip(*g)
    ]
    assert [m.role for m in t.messages] == ["user", "assistant", "tool", "assistant"]
    await envpool.destroy(t.sandbox)


async def test_command_harness_uses_the_bridge(envpool):
    # Any language: here bash and curl-less Python, calling the endpoint and kiln-exec.
    script = (
        f'{sys.executable} -c "import openai,os; c=openai.OpenAI(max_retries=0); '
        "print(c.chat.completions.create(model='m', messages=[{'role':'user','content':os.environ['KILN_PROBLEM_STATEMENT']}]).choices[0].message.content)\" "
        f"&& {sys.executable} -m kiln.rollout.harness.bridge \"sed -i 's/a - b/a + b/' calc.py\" && {sys.executable} -m kiln.rollout.harness.bridge cat calc.py"
    )
    t = await run(envpool, Scripted(["On it."]), HarnessSettings(kind="command", entry=script))
    assert t.finish_reason == "harness_done", t.harness_log
    assert "On it." in t.harness_log and "a + b" in t.harness_log
    assert t.final_diff.changed == {"calc.py": "def add(a, b):\n    return a + b\n"}
    await envpool.destroy(t.sandbox)


SEEN: dict = {}


async def past_the_context(task, client, sandbox):
    """A Python harness that asks with a prompt longer than the episode's context, then
    with a short one and room for more tokens than the context has left."""
    try:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 200}])
    except openai.BadRequestError as e:
        SEEN["refused"] = e.code
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=500)
    SEEN["finish"], SEEN["usage"] = r.choices[0].finish_reason, r.usage


async def test_the_harness_path_honours_max_context_tokens(envpool):
    """``max_total_tokens`` bounds each call's context for an external harness as it does
    for kiln's own loop: a prompt that fills it is refused and recorded nowhere, and a
    completion stops where prompt plus completion would pass it (the generation budget,
    the same number, would have let it run on)."""
    limit = 48
    SEEN.clear()
    engine = Scripted(["word " * 100])
    harness = HarnessSettings(kind="python", entry="test_harness:past_the_context")
    t = await run(envpool, engine, harness, max_total_tokens=limit, max_new_tokens=500)
    assert t.status == c.TrajectoryStatus.FINISHED and t.finish_reason == "harness_done", t.harness_log
    assert SEEN["refused"] == "context_length_exceeded"
    usage = SEEN["usage"]
    assert SEEN["finish"] == "length" and usage.total_tokens < limit and usage.completion_tokens < limit - 1
    assert len(engine.prompts) == 1 and len(engine.prompts[0]) == usage.prompt_tokens  # the refused call never ran
    assert len(t.token_ids) < limit and not t.segments  # nor is any of it in the trajectory
    assert sum(t.loss_mask) == usage.completion_tokens
    await envpool.destroy(t.sandbox)


@pytest.mark.parametrize(
    "harness,outcome,log",
    [
        (HarnessSettings(kind="python", entry="test_harness:crash"), "harness_error", "fell over"),
        (HarnessSettings(kind="command", entry="echo started; exit 3"), "harness_error", "exit code 3"),
        (HarnessSettings(kind="command", entry="exec sleep 3600", grace_s=0.5), "timeout", ""),
    ],
)
async def test_a_failing_harness_ends_with_its_reason_and_no_sandbox(envpool, bus, harness, outcome, log):
    # Only the hanging harness meets its deadline; the others end by themselves first.
    t = await run(envpool, Scripted(["x"]), harness, deadline_s=2 if outcome == "timeout" else 120)
    assert t.status == c.TrajectoryStatus.FINISHED and t.finish_reason == outcome and t.sandbox is None
    assert log in t.harness_log
    stats = await envpool.stats(
        (
            await envpool.bus.request(c.ENVPOOL_CREATE, c.SandboxCreate(task_id=TASK.id), c.SandboxCreated)
        ).sandbox.node_id
    )
    assert stats.leased == 1  # only the one just created to ask: the harness's is gone


async def test_a_repeated_answer_is_written_as_each_of_its_own_tokens():
    """The same answer twice, generated as different tokens (the second spelled one
    character per token): each repeat in the history is written as the tokens of its own
    generation, in order, so the history extends and nothing is trained twice."""
    from test_agent import SpelledEngine

    class Twice(SpelledEngine):
        async def generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
            if self.calls == 0:
                self.calls += 1
                self.prompts.append(list(prompt_ids))
                ids = TOK.encode(self.turns.pop(0), add_special_tokens=False).ids
                return Generation(ids, [-0.5] * len(ids), self.version, "stop")
            return await super().generate(prompt_ids, max_new_tokens, stop_ids, temperature, seed)

    engine = Twice(["I checked it." + chat.EOS] * 2 + ["Thanks, all done here." + chat.EOS])
    e = Episode(
        "e",
        engine,
        TOK,
        tool_format("hermes"),
        Budget(10_000, 10, time.time() + 600, 64),
        seed=1,
        temperature=1.0,
        wait_resume=None,
    )
    msgs = [{"role": "user", "content": "check it"}]
    for follow in ("again", "once more"):
        (ch,) = (await e.complete(msgs, [])).choices
        msgs += [{"role": "assistant", "content": ch.prose}, {"role": "user", "content": follow}]
    first, second = (rec.choices[0].completion for rec in e.calls)
    assert first.ids != second.ids and TOK.decode(first.ids) == TOK.decode(second.ids)
    await e.complete(msgs, [])
    e.finish()
    assert not e.segments and all(rec.extended for rec in e.calls[1:])
    assert [t for t, m in zip(e.seq.ids, e.seq.mask) if m] == first.ids + second.ids + e.calls[2].choices[
        0
    ].completion.ids
