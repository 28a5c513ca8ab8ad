"""The agent loop with a scripted engine (its logic) against a real env-pool over a
real nats-server: multi-turn tool use, parallel calls, malformed calls as
observations, token bookkeeping and loss masks, budgets and infra errors."""

from __future__ import annotations

import asyncio
import json
import time

from opentelemetry import trace

from kiln.learner.policy import tokenizer_corpus
from kiln.rollout.agent import run_episode
from kiln.rollout.config import RolloutSettings
from kiln.rollout.engine import Generation, InferenceEngine
from kiln.rollout.lifecycle import EpisodeSpec, Stale
from kiln.shared import chat
from kiln.shared import contracts as c
from kiln.shared.model.tokenizer import train_tokenizer
from kiln.shared.tasks import load_suite

SUITE = load_suite("builtin")
TASK = SUITE.get("fix-calc")
TOK = train_tokenizer(tokenizer_corpus(SUITE, 1), 1024)


class ScriptedEngine(InferenceEngine):
    """Plays back fixed assistant turns, token by token as a model would emit them."""

    def __init__(self, turns: list[str], version: int = 7):
        self.turns = list(turns)
        self.version = version
        self.prompts: list[list[int]] = []

    async def load(self, version, folder):
        self.version = version

    async def abort(self):
        pass

    async def generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = TOK.encode(self.turns.pop(0), add_special_tokens=False).ids
        if len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        else:
            finish = "stop" if ids and ids[-1] in stop_ids else "length"
        return Generation(ids, [-0.25] * len(ids), self.version, finish)


def tool_call(name, **args) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def request(**kw) -> c.RolloutRequest:
    return c.RolloutRequest(
        run_id="r",
        group_id="g0",
        task_id=TASK.id,
        n_samples=1,
        dispatch_version=7,
        deadline=kw.pop("deadline", time.time() + 60),
        **kw,
    )


async def episode(engine, envpool, tools=(), **settings):
    spec = EpisodeSpec(
        request=request(), sample_index=0, task=TASK, worker_id="w", seed=1, temperature=1.0, tools=tools
    )
    return await run_episode(spec, engine, TOK, envpool, RolloutSettings(**settings), trace.get_tracer("t"))


async def test_multi_turn_episode_fixes_the_bug(envpool):
    engine = ScriptedEngine(
        [
            "Let me look."
            + tool_call("read_file", path="calc.py")
            + tool_call("list_dir")
            + "<tool_call>{oops</tool_call>"
            + chat.EOS,
            tool_call("edit_file", path="calc.py", old="a - b", new="a + b") + tool_call("frobnicate") + chat.EOS,
            tool_call("run_terminal_cmd", command=TASK.test_command) + chat.EOS,
            "Fixed: add now returns the sum." + chat.EOS,
        ]
    )
    t = await episode(engine, envpool, max_turns=6)
    assert t.status == c.TrajectoryStatus.FINISHED and t.finish_reason == "no_tool_call" and t.num_turns == 4
    assert t.malformed_tool_calls == 2  # bad JSON, unknown tool
    roles = [m.role for m in t.messages]
    assert roles == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "tool",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    tools = [m.content for m in t.messages if m.role == "tool"]
    assert tools[0] == TASK.files["calc.py"] and tools[1] == "calc.py\ntest_calc.py"
    assert "not valid JSON" in json.loads(tools[2])["error"]
    assert tools[3] == "edited calc.py" and "unknown tool" in json.loads(tools[4])["error"]
    assert "exit code: 0" in tools[5] and "OK" in tools[5]

    # Token bookkeeping: exactly the generated tokens are trained, each with its logprob and version.
    gen = [i for i, m in enumerate(t.loss_mask) if m]
    assert [t.token_versions[i] for i in gen] == [7] * len(gen)
    assert all(t.logprobs[i] == -0.25 for i in gen)
    assert all(t.token_versions[i] == -1 and t.logprobs[i] == 0.0 for i, m in enumerate(t.loss_mask) if not m)
    # What the engine saw at each turn is a prefix of the final sequence (nothing re-tokenized).
    for prompt in engine.prompts:
        assert t.token_ids[: len(prompt)] == prompt
    text = TOK.decode(t.token_ids, skip_special_tokens=False)
    assert "<tool_response>\ndef add(a, b):" in text and text.count("<|im_start|>assistant\n") == 4

    # The sandbox holds the fixed workspace for reward, and the trajectory carries it as a diff.
    r = await envpool.exec(t.sandbox, TASK.test_command, 30)
    assert r.exit_code == 0
    assert t.final_diff.changed == {"calc.py": TASK.files["calc.py"].replace("a - b", "a + b")}
    assert t.final_diff.deleted == [] and t.final_diff.binary == []


async def test_calls_with_bad_arguments_are_observations(envpool):
    engine = ScriptedEngine(
        [
            tool_call("read_file", file="calc.py")
            + tool_call("edit_file", path="calc.py", old=3, new="x")
            + tool_call("read_file", path="calc.py", start_line="one")
            + chat.EOS,
            tool_call("read_file", path="calc.py") + chat.EOS,
            "Nothing to fix." + chat.EOS,
        ]
    )
    # Room for the three calls of the first turn (the default budget would cut the third).
    t = await episode(engine, envpool, max_turns=4, max_new_tokens=512)
    assert t.status == c.TrajectoryStatus.FINISHED and t.finish_reason == "no_tool_call" and t.malformed_tool_calls == 3
    tool_results = [m.content for m in t.messages if m.role == "tool"]
    errors = [json.loads(r)["error"] for r in tool_results[:3]]
    assert "read_file: path: Field required" in errors[0] and "file: Extra inputs" in errors[0]
    assert "edit_file: old: Input should be a valid string" in errors[1]
    assert "start_line: Input should be a valid integer" in errors[2]
    # The worker went on: the next turn's valid call was executed.
    assert tool_results[3] == TASK.files["calc.py"]
    assert t.final_diff.changed == {}


async def test_only_the_offered_tools_are_in_the_prompt_and_callable(envpool):
    engine = ScriptedEngine(
        [
            tool_call("run_terminal_cmd", command=TASK.test_command)
            + tool_call("read_file", path="calc.py")
            + chat.EOS,
            "Done." + chat.EOS,
        ]
    )
    t = await episode(engine, envpool, tools=("edit_file", "read_file"))
    system = TOK.decode(engine.prompts[0], skip_special_tokens=False)
    assert '"name": "read_file"' in system and '"name": "edit_file"' in system
    assert "run_terminal_cmd" not in system and "semantic_search" not in system
    observations = [m.content for m in t.messages if m.role == "tool"]
    assert json.loads(observations[0]) == {
        "error": "unknown tool 'run_terminal_cmd'; available tools: read_file, edit_file"
    }
    assert observations[1] == TASK.files["calc.py"] and t.malformed_tool_calls == 1


async def test_budgets_end_the_episode(envpool):
    looping = [tool_call("list_dir") + chat.EOS] * 10
    t = await episode(ScriptedEngine(list(looping)), envpool, max_turns=3)
    assert t.finish_reason == "max_turns" and t.num_turns == 3
    t = await episode(ScriptedEngine(["x" * 400]), envpool, max_turns=3, max_new_tokens=8)
    assert sum(t.loss_mask) == 8  # cut at the per-turn budget, then closed with a masked EOS
    long_prompt = len(TOK.encode(chat.render_system(chat.SYSTEM_PROMPT, []), add_special_tokens=False).ids)
    t = await episode(ScriptedEngine(list(looping)), envpool, max_turns=5, max_total_tokens=long_prompt)
    assert t.finish_reason == "max_tokens" and t.num_turns == 0


async def test_first_turn_generates_while_the_sandbox_is_created(envpool, monkeypatch):
    events = []
    create = envpool.create
    generated = asyncio.Event()

    async def slow_create(*a, **kw):
        events.append("create-start")
        # The sandbox is ready only once turn 1 has generated: an agent that waited for it
        # first would never get it (and fail here, not hang).
        await asyncio.wait_for(generated.wait(), 30)
        ref = await create(*a, **kw)
        events.append("create-done")
        return ref

    class Recording(ScriptedEngine):
        async def generate(self, *a, **kw):
            events.append("generate")
            generated.set()
            return await super().generate(*a, **kw)

    monkeypatch.setattr(envpool, "create", slow_create)
    t = await episode(
        Recording(["Reading." + tool_call("read_file", path="calc.py") + chat.EOS, "Done." + chat.EOS]), envpool
    )
    assert t.status == c.TrajectoryStatus.FINISHED and t.num_turns == 2
    assert events == ["generate", "create-start", "create-done", "generate"]  # turn 1 did not wait for the sandbox
    assert "def " in t.messages[3].content  # the tool ran in the sandbox once it existed


async def test_unknown_task_sandbox_is_an_infra_error(envpool):
    spec = EpisodeSpec(
        request=request(),
        sample_index=0,
        task=TASK.model_copy(update={"id": "nope"}),
        worker_id="w",
        seed=1,
        temperature=1.0,
    )
    t = await run_episode(
        spec, ScriptedEngine(["hi" + chat.EOS]), TOK, envpool, RolloutSettings(), trace.get_tracer("t")
    )
    assert t.status == c.TrajectoryStatus.INFRA_ERROR and "unknown_task" in t.infra_error and t.sandbox is None


class AbortingEngine(ScriptedEngine):
    """Emits the first ``cut`` tokens of its first turn, then behaves as if an abort hit."""

    def __init__(self, turns, cut: int, suspend, version: int = 7):
        super().__init__(turns, version)
        self.cut, self.suspend, self.rest = cut, suspend, None

    async def generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
        if self.cut is not None:
            self.prompts.append(list(prompt_ids))
            ids = TOK.encode(self.turns.pop(0), add_special_tokens=False).ids
            head, self.rest, self.cut = ids[: self.cut], ids[self.cut :], None
            self.suspend.set()
            return Generation(head, [-0.5] * len(head), self.version, "abort")
        if self.rest is not None:  # the resumed turn continues exactly where it stopped
            self.prompts.append(list(prompt_ids))
            ids, self.rest = self.rest, None
            return Generation(ids, [-0.75] * len(ids), self.version, "stop")
        return await super().generate(prompt_ids, max_new_tokens, stop_ids, temperature, seed)


async def test_suspended_mid_turn_resumes_with_each_token_tagged(envpool):
    """A sample aborted under version 7 halfway through a tool call resumes under 8: the
    turn is parsed whole, tokens before the cut keep version 7 and their logprobs, those
    after carry 8, and the episode goes on in the same sandbox."""
    suspend = asyncio.Event()
    turn = "Reading." + tool_call("read_file", path="calc.py") + chat.EOS
    engine = AbortingEngine([turn, "Done." + chat.EOS], cut=5, suspend=suspend)
    spec = EpisodeSpec(
        request=request(), sample_index=0, task=TASK, worker_id="w", seed=1, temperature=1.0, max_staleness=1
    )
    partial = await run_episode(spec, engine, TOK, envpool, RolloutSettings(), trace.get_tracer("t"), suspend=suspend)
    assert isinstance(partial, c.PartialSample) and partial.turn_tokens == 5 and partial.num_turns == 0
    assert partial.sandbox is not None and partial.oldest_version() == 7
    partial = c.PartialSample.model_validate_json(partial.model_dump_json())  # it travels as a message

    # Suspended again before generating anything: nothing is lost or added.
    again = await run_episode(
        spec, engine, TOK, envpool, RolloutSettings(), trace.get_tracer("t"), suspend=suspend, resume=partial
    )
    assert again == partial
    suspend.clear()
    engine.version = 8
    t = await run_episode(
        spec, engine, TOK, envpool, RolloutSettings(), trace.get_tracer("t"), suspend=suspend, resume=partial
    )
    assert t.status == c.TrajectoryStatus.FINISHED and t.num_turns == 2 and t.finish_reason == "no_tool_call"
    assert t.messages[2].role == "assistant" and t.messages[2].content == turn.removesuffix(chat.EOS)
    assert t.messages[3].role == "tool" and t.messages[3].content == TASK.files["calc.py"]
    gen = [i for i, m in enumerate(t.loss_mask) if m]
    versions = [t.token_versions[i] for i in gen]
    logprobs = [t.logprobs[i] for i in gen]
    assert versions[:5] == [7] * 5 and set(versions[5:]) == {8}
    assert logprobs[:5] == [-0.5] * 5 and logprobs[5] == -0.75
    assert t.token_ids[: len(partial.token_ids)] == partial.token_ids
    assert t.sandbox == partial.sandbox

    # Two versions later the same partial is too stale to continue (max_staleness 1).
    engine.version = 9
    stale = await run_episode(
        spec, engine, TOK, envpool, RolloutSettings(), trace.get_tracer("t"), suspend=suspend, resume=partial
    )
    assert isinstance(stale, Stale) and "2 versions old" in stale.detail


async def test_sandbox_lease_runs_to_the_group_deadline_plus_the_scoring_buffer(envpool):
    import httpx

    engine = ScriptedEngine(["Done." + chat.EOS])
    deadline = time.time() + 500
    spec = EpisodeSpec(
        request=request(deadline=deadline), sample_index=0, task=TASK, worker_id="w", seed=1, temperature=1.0
    )
    t = await run_episode(
        spec, engine, TOK, envpool, RolloutSettings(sandbox_score_buffer_s=120), trace.get_tracer("t")
    )
    stats = await envpool.stats(t.sandbox.node_id)
    async with httpx.AsyncClient(base_url=stats.http_url) as h:
        listing = (await h.get("/sandboxes")).json()["sandboxes"]
    lease = next(s for s in listing if s["sandbox_id"] == t.sandbox.sandbox_id)
    # Leased until reward has had its buffer after the deadline: not a fixed TTL.
    assert lease["state"] == "leased" and abs(lease["expires_at"] - (deadline + 120)) < 5, (lease, deadline)
    await envpool.destroy(t.sandbox)


class SpelledEngine(ScriptedEngine):
    """Writes each turn one character per token: the same text as ``ScriptedEngine``, but
    not the ids that encoding the text gives, so a turn re-encoded from its text would
    not be the tokens the model generated."""

    def __init__(self, turns, suspend: asyncio.Event | None = None, suspend_after: int | None = None, version: int = 7):
        super().__init__(turns, version)
        self.suspend, self.suspend_after, self.calls = suspend, suspend_after, 0

    async def generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
        self.prompts.append(list(prompt_ids))
        text = self.turns.pop(0)
        body = text.removesuffix(chat.EOS)
        ids = [i for ch in body for i in TOK.encode(ch, add_special_tokens=False).ids]
        ids += TOK.encode(chat.EOS, add_special_tokens=False).ids if text.endswith(chat.EOS) else []
        assert ids != TOK.encode(text, add_special_tokens=False).ids
        self.calls += 1
        if self.calls == self.suspend_after:  # the abort arrives while this turn's tools run
            self.suspend.set()
        return Generation(ids, [-0.1 * self.calls] * len(ids), self.version, "stop")


async def test_suspended_between_turns_resumes_token_for_token_elsewhere(envpool):
    """A sample suspended between turns travels as a message and continues in a fresh
    loop (another worker): the tokens the model generated are written as generated, not
    re-encoded from their text (the kept completions travel with it), so the trajectory
    is one segment and equals the one an uninterrupted run produces."""
    turns = [
        "Reading." + tool_call("read_file", path="calc.py") + chat.EOS,
        tool_call("list_dir") + chat.EOS,
        "Done." + chat.EOS,
    ]
    spec = EpisodeSpec(request=request(), sample_index=0, task=TASK, worker_id="w", seed=1, temperature=1.0)
    whole = await run_episode(spec, SpelledEngine(list(turns)), TOK, envpool, RolloutSettings(), trace.get_tracer("t"))
    assert whole.status == c.TrajectoryStatus.FINISHED and whole.num_turns == 3 and not whole.segments

    suspend = asyncio.Event()
    engine = SpelledEngine(list(turns), suspend, suspend_after=2)
    partial = await run_episode(spec, engine, TOK, envpool, RolloutSettings(), trace.get_tracer("t"), suspend=suspend)
    assert isinstance(partial, c.PartialSample) and partial.num_turns == 2 and partial.turn_tokens == 0
    assert partial.episode is not None and partial.episode.open_call is not None
    assert [k.at is not None for k in partial.episode.completions] == [True, True]
    partial = c.PartialSample.from_bytes(partial.to_bytes())
    suspend.clear()
    t = await run_episode(
        spec, engine, TOK, envpool, RolloutSettings(), trace.get_tracer("t"), suspend=suspend, resume=partial
    )
    assert t.status == c.TrajectoryStatus.FINISHED and t.num_turns == 3 and not t.segments
    assert (t.token_ids, t.loss_mask, t.logprobs) == (whole.token_ids, whole.loss_mask, whole.logprobs)
    assert [m.content for m in t.messages] == [m.content for m in whole.messages]
    await envpool.destroy(whole.sandbox)
    await envpool.destroy(t.sandbox)

    # Suspended by a worker from before episodes travelled: no kept completions, so its
    # next call cannot be stitched token for token: a new segment, with the reason.
    suspend = asyncio.Event()
    engine = SpelledEngine(list(turns), suspend, suspend_after=1)
    old = await run_episode(spec, engine, TOK, envpool, RolloutSettings(), trace.get_tracer("t"), suspend=suspend)
    old = old.model_copy(update={"episode": None})
    suspend.clear()
    t = await run_episode(
        spec, engine, TOK, envpool, RolloutSettings(), trace.get_tracer("t"), suspend=suspend, resume=old
    )
    assert t.status == c.TrajectoryStatus.FINISHED and t.num_turns == 3
    (seg,) = t.segments
    assert "does not extend" in seg.reason and seg.start > len(old.token_ids)
    assert sum(t.loss_mask) == sum(whole.loss_mask)  # every generated token trained once
    await envpool.destroy(t.sandbox)


async def test_the_loop_speaks_the_configured_tool_format(envpool):
    """kiln's own loop writes and reads the served model's tool-call syntax
    (``rollout.harness.tool_format``), here Qwen3-Coder's XML."""
    from kiln.rollout.config import HarnessSettings
    from kiln.shared.toolformats import tool_format

    call = tool_format("qwen3_coder").render([("read_file", {"path": "calc.py"})])
    engine = ScriptedEngine(["Reading.\n" + call + chat.EOS, "Done." + chat.EOS])
    t = await episode(engine, envpool, harness=HarnessSettings(tool_format="qwen3_coder"))
    assert t.status == c.TrajectoryStatus.FINISHED and t.finish_reason == "no_tool_call" and t.malformed_tool_calls == 0
    assert "<function=example_function_name>" in TOK.decode(engine.prompts[0], skip_special_tokens=False)
    assert t.messages[2].tool_calls[0].name == "read_file" and t.messages[3].content == TASK.files["calc.py"]
    await envpool.destroy(t.sandbox)


async def test_a_command_past_the_turns_tool_time_is_an_observation_not_an_infra_error(envpool):
    """A slow command is the policy's own doing: env-pool kills it at what is left of the
    turn's tool time and answers within it, so the episode goes on (never infra_error)."""
    engine = ScriptedEngine(
        [
            tool_call("run_terminal_cmd", command="sleep 60", timeout=60)
            + tool_call("run_terminal_cmd", command="echo later")
            + chat.EOS,
            tool_call("write_file", path="a/" * 130 + "x.py", content="x") + chat.EOS,
            "Done." + chat.EOS,
        ]
    )
    t0 = time.monotonic()
    t = await episode(engine, envpool, max_turns=4, max_new_tokens=512, tool_timeout_s=2.0)
    assert time.monotonic() - t0 < 30  # the 60 s sleep was cut at the turn's 2 s
    assert t.status == c.TrajectoryStatus.FINISHED and t.infra_error is None and t.finish_reason == "no_tool_call"
    slow, later, long_path = [m.content for m in t.messages if m.role == "tool"]
    assert "exit code: -9" in slow and "[killed: command exceeded its" in slow
    assert "this turn's time for tool calls was spent" in json.loads(later)["error"]
    assert (
        "131 levels long; workspace paths have at most 1024 characters and 128 levels" in json.loads(long_path)["error"]
    )
    assert t.final_diff.changed == {} and not t.final_diff.truncated
