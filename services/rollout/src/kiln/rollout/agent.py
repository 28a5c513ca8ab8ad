"""kiln's own agent loop: one harness of the sample lifecycle (``lifecycle.Harness``).

generate -> parse tool calls -> env-pool runs them as one batch -> append the
observations -> generate ... until the model answers without a tool call, or a limit
(turns, tokens, deadline) ends the episode.

It is a harness like any other (``BuiltinHarness``, beside the external harnesses of
``harness.external``): ``SampleLifecycle`` (``lifecycle.py``) leases its sandbox, sets its
budget, takes its final diff and assembles its ``Trajectory``; ``AgentLoop`` keeps the
conversation as chat messages and sends each turn's messages to the sample's ``Episode``
(``episode.py``), the same machinery that serves external harnesses through the
OpenAI-compatible endpoint. Rendering, the tool-call syntax (``rollout.harness.tool_format``),
token stitching, budgets and suspension are the episode's; the loop adds what is kiln's
own: its prompt and tools, running calls in env-pool, APRIL suspension across workers and
the staleness bound.

Invariants of the sample it plays:
- ``token_ids`` is exactly what the model conditioned on, in order: generated tokens
  are appended as generated (never re-tokenized), prompt and observation tokens as
  encoded; ``loss_mask`` is 1 only on generated tokens, which alone carry a logprob
  and a policy version;
- a malformed tool call (does not parse, unknown tool, bad arguments) is answered with
  an ``{"error": ...}`` observation and counted, never raised;
- a failure of the infrastructure (env-pool unreachable, sandbox lost) ends the
  episode with ``status = infra_error`` and the cause, so reward and the learner can
  mask it instead of scoring it 0; what the policy asks for never does: a turn's tool
  calls carry the turn's time (``tool_timeout_s``) and env-pool answers within it, a
  command that outlives it killed and its observation saying so, and the final diff of
  any workspace is bounded (a truncated diff is reward's ``not_applied``);
- an episode is resumable: when ``suspend`` is set (an APRIL abort) it stops at once,
  mid-generation or between turns, and returns a ``PartialSample`` holding everything
  sampled so far (with the episode's own state: kept completions, the open call);
  the lifecycle given ``resume=partial`` continues it exactly there, on any worker, and
  the tokens it adds carry the versions that produced them;
- an episode whose oldest generated token is more than ``max_staleness`` versions
  behind the engine is not continued: it returns ``Stale`` so its group is dropped;
- the first turn does not wait for the sandbox: the lifecycle starts its creation and
  the prompt needs only the task and the tool schemas; it is awaited where the sandbox
  is first needed (tools, a suspension, the lifecycle's final diff), so provisioning
  latency overlaps generation instead of adding to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from opentelemetry import trace
from tokenizers import Tokenizer

from kiln.rollout.config import RolloutSettings
from kiln.rollout.engine import InferenceEngine
from kiln.rollout.episode import Suspended, as_openai
from kiln.rollout.lifecycle import EpisodeSpec, Played, SampleContext, SampleLifecycle, Stale
from kiln.shared import chat
from kiln.shared import contracts as c
from kiln.shared.bus import RemoteError
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.tools import ToolCallError, tool_schemas, validate_call

log = logging.getLogger("kiln.rollout.agent")


def clip_text(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


class BuiltinHarness:
    """kiln's own loop as a ``lifecycle.Harness``: it suspends on an abort (APRIL)."""

    suspends = True

    def __init__(self, tracer: trace.Tracer):
        self.tracer = tracer

    async def play(self, sample: SampleContext) -> Played | c.PartialSample | Stale:
        return await AgentLoop(sample, self.tracer).run()


class AgentLoop:
    """One sample played by kiln's own agent, its state in fields (so it can be suspended)."""

    def __init__(self, sample: SampleContext, tracer: trace.Tracer):
        self.sample, self.spec, self.settings, self.tracer = sample, sample.spec, sample.settings, tracer
        self.engine, self.envpool, self.episode = sample.engine, sample.envpool, sample.episode
        self.format = self.episode.format
        self.tools = tool_schemas(self.spec.tools)
        self.openai: list[dict] = [as_openai(m, self.format, self.tools) for m in sample.messages]
        """``sample.messages`` as the episode reads them (kept alongside: each is converted once)."""
        if not sample.resumed:
            self.add(c.ChatMessage(role="system", content=chat.SYSTEM_PROMPT))
            self.add(c.ChatMessage(role="user", content=self.spec.task.problem_statement))

    def add(self, message: c.ChatMessage) -> None:
        self.sample.messages.append(message)
        self.openai.append(as_openai(message, self.format, self.tools))

    # --- the loop ------------------------------------------------------------

    async def run(self) -> Played | c.PartialSample | Stale:
        spec, s, ep, sample = self.spec, self.settings, self.episode, self.sample
        suspend = sample.suspend
        finish = "max_turns"
        while sample.turns < s.max_turns:
            if ep.open is None:
                ep.open_call(self.openai, self.tools)
            if ep.room() <= 0 and not ep.pending_tokens():
                finish = "max_tokens"
                break
            if time.time() > spec.request.deadline:
                finish = "deadline"
                break
            oldest = ep.oldest()
            if (
                spec.max_staleness is not None
                and oldest is not None
                and self.engine.version - oldest > spec.max_staleness
            ):
                return Stale(
                    spec.sample_index,
                    f"oldest token is {self.engine.version - oldest} versions old (max {spec.max_staleness})",
                    await sample.sandbox(),
                )
            if suspend is not None and suspend.is_set():
                return await self.suspended()
            with self.tracer.start_as_current_span(
                "rollout.generate", attributes={"turn": sample.turns, "resumed_tokens": ep.pending_tokens()}
            ) as span:
                try:
                    (choice,) = (await ep.generate(self.tools)).choices
                except Suspended:
                    span.set_attribute("finish_reason", "abort")
                    return await self.suspended()
                comp = choice.completion
                span.set_attribute("policy.version", comp.versions[-1] if comp.versions else self.engine.version)
                span.set_attribute("tokens", len(comp.ids))
                span.set_attribute("finish_reason", choice.finish)
            sample.turns += 1
            parsed = choice.calls
            self.add(
                c.ChatMessage(
                    role="assistant",
                    content=choice.text,
                    version=comp.versions[-1] if comp.ids else self.engine.version,
                    tool_calls=[
                        c.ToolCall(
                            id=p.id, name=p.name or "?", arguments=p.arguments if isinstance(p.arguments, dict) else {}
                        )
                        for p in parsed
                    ],
                )
            )
            if not parsed:
                finish = "no_tool_call"
                break
            try:
                results = await self.run_tools(parsed)
            except RemoteError as e:
                return Played("error", scored=False, infra_error=f"tool execution failed: {e}")
            for p in parsed:
                self.add(
                    c.ChatMessage(
                        role="tool", content=clip_text(results[p.id], s.max_observation_chars), tool_call_id=p.id
                    )
                )
        ep.finish(close=True)  # the last turn closes the way the chat template closes it
        return Played(finish)

    async def run_tools(self, parsed: list[chat.ParsedCall]) -> dict[str, str]:
        """Observations by call id: errors for calls that are malformed, the sandbox's
        results (run as one batch) for the others."""
        results: dict[str, str] = {}
        valid: list[c.ToolCall] = []
        for p in parsed:
            if p.error:  # counted by the episode
                results[p.id] = json.dumps({"error": p.error})
                continue
            try:
                validate_call(p.name, p.arguments, self.spec.tools)
            except ToolCallError as e:
                results[p.id] = json.dumps({"error": str(e)})
                self.sample.invalid += 1
                continue
            valid.append(c.ToolCall(id=p.id, name=p.name, arguments=p.arguments))
        if valid:
            sandbox = await self.sample.sandbox()
            with self.tracer.start_as_current_span("rollout.tools", attributes={"calls": len(valid)}):
                for r in await self.envpool.tools(sandbox, valid, timeout_s=self.settings.tool_timeout_s):
                    results[r.call_id] = json.dumps({"error": r.error}) if r.error else r.output
        return results

    async def suspended(self) -> c.PartialSample:
        sample = self.sample
        sandbox = await sample.sandbox()
        seq, turn_tokens, state = self.episode.snapshot()
        return c.PartialSample(
            sample_index=self.spec.sample_index,
            token_ids=seq.ids,
            logprobs=seq.logprobs,
            token_versions=seq.versions,
            loss_mask=seq.mask,
            messages=sample.messages,
            num_turns=sample.turns,
            turn_tokens=turn_tokens,
            malformed_tool_calls=sample.malformed,
            sandbox=sandbox,
            started_at=sample.started_at,
            worker_id=self.spec.worker_id,
            episode=state,
        )


async def run_episode(
    spec: EpisodeSpec,
    engine: InferenceEngine,
    tokenizer: Tokenizer,
    envpool: EnvPoolClient,
    settings: RolloutSettings,
    tracer: trace.Tracer,
    *,
    suspend: asyncio.Event | None = None,
    resume: c.PartialSample | None = None,
) -> c.Trajectory | c.PartialSample | Stale:
    """One sample played by kiln's own loop, through the lifecycle (tests and benchmarks)."""
    lifecycle = SampleLifecycle(
        spec, BuiltinHarness(tracer), engine, tokenizer, envpool, settings, suspend=suspend, resume=resume
    )
    return await lifecycle.run()
