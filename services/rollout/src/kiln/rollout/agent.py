"""kiln's own agent loop: one episode of one task in one sandbox.

generate -> parse tool calls -> env-pool runs them as one batch -> append the
observations -> generate ... until the model answers without a tool call, or a limit
(turns, tokens, deadline) ends the episode.

It is a harness like any other: ``AgentLoop`` keeps the conversation as chat messages
and sends each turn's messages to an ``Episode`` (``episode.py``), the same machinery
that serves external harnesses through the OpenAI-compatible endpoint. Rendering, the
tool-call syntax (``rollout.harness.tool_format``), token stitching, budgets and
suspension are the episode's; the loop adds what is kiln's own: its prompt and tools,
running calls in env-pool, APRIL suspension across workers and the staleness bound.

Invariants of the trajectory it returns:
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
  ``run_episode(..., resume=partial)`` continues it exactly there, on any worker, and
  the tokens it adds carry the versions that produced them;
- an episode whose oldest generated token is more than ``max_staleness`` versions
  behind the engine is not continued: it returns ``Stale`` so its group is dropped;
- the first turn does not wait for the sandbox: its creation runs alongside the first
  generation (the prompt needs only the task and the tool schemas) and is awaited
  where the sandbox is first needed (tools, the final diff, a suspension), so
  provisioning latency overlaps generation instead of adding to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from opentelemetry import trace
from tokenizers import Tokenizer

from kiln.rollout.config import RolloutSettings
from kiln.rollout.engine import InferenceEngine
from kiln.rollout.episode import Budget, Episode, Suspended, as_openai
from kiln.shared import chat
from kiln.shared import contracts as c
from kiln.shared.bus import RemoteError
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.tasks import Task
from kiln.shared.toolformats import tool_format
from kiln.shared.tools import ToolCallError, tool_schemas, validate_call

log = logging.getLogger("kiln.rollout.agent")


@dataclass
class EpisodeSpec:
    request: c.RolloutRequest
    sample_index: int
    task: Task
    worker_id: str
    seed: int
    temperature: float
    max_staleness: int | None = None
    """None: no staleness check (sync and async modes leave it to the learner)."""
    tools: tuple[str, ...] = ()
    """The tools offered (``tasks.tools``); empty: all."""


@dataclass
class Stale:
    sample_index: int
    detail: str
    sandbox: c.SandboxRef | None


class SandboxFailed(Exception):
    """The sandbox could not be created: the episode ends as an infrastructure error."""

    def __init__(self, error: RemoteError):
        super().__init__(str(error))
        self.error = error


def clip_text(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


class AgentLoop:
    """One episode of kiln's own agent, its state in fields (so it can be suspended)."""

    def __init__(
        self,
        spec: EpisodeSpec,
        engine: InferenceEngine,
        tokenizer: Tokenizer,
        envpool: EnvPoolClient,
        settings: RolloutSettings,
        tracer: trace.Tracer,
        suspend: asyncio.Event | None,
    ):
        req = spec.request
        self.spec, self.engine, self.envpool, self.settings, self.tracer = spec, engine, envpool, settings, tracer
        self.suspend = suspend
        self.format = tool_format(settings.harness.tool_format)
        self.tools = tool_schemas(spec.tools)
        self.trajectory_id = f"{req.group_id}-s{spec.sample_index}"
        budget = Budget(
            max_generated_tokens=settings.max_total_tokens,
            max_calls=settings.max_turns,
            deadline=req.deadline,
            max_tokens_per_call=settings.max_new_tokens,
            max_context_tokens=settings.max_total_tokens,
        )
        self.episode = Episode(
            self.trajectory_id,
            engine,
            tokenizer,
            self.format,
            budget,
            seed=spec.seed,
            temperature=spec.temperature,
            wait_resume=None,
        )
        self.messages: list[c.ChatMessage] = []
        self.openai: list[dict] = []
        """``messages`` as the episode reads them (kept alongside: each is converted once)."""
        self.turns = 0
        self.invalid = 0
        """Calls that parsed but name an unknown tool or carry bad arguments."""
        self.sandbox: c.SandboxRef | None = None
        self.creating: asyncio.Task | None = None
        self.started_at = time.time()

    # --- state ---------------------------------------------------------------

    def start(self) -> None:
        req, task = self.spec.request, self.spec.task
        self.add(c.ChatMessage(role="system", content=chat.SYSTEM_PROMPT))
        self.add(c.ChatMessage(role="user", content=task.problem_statement))
        # Leased to the group's deadline (after which the controller drops the group) plus the
        # scoring time reward needs; the floor keeps a request dispatched late from a zero lease.
        ttl = max(req.deadline - time.time(), 1.0) + self.settings.sandbox_score_buffer_s
        self.creating = asyncio.create_task(self.envpool.create(task.id, run_id=req.run_id, ttl_s=ttl))

    def restore(self, partial: c.PartialSample) -> None:
        self.episode.restore(partial)
        for m in partial.messages:
            self.add(m)
        self.turns, self.sandbox, self.started_at = partial.num_turns, partial.sandbox, partial.started_at
        self.invalid = partial.malformed_tool_calls - self.episode.malformed

    def add(self, message: c.ChatMessage) -> None:
        self.messages.append(message)
        self.openai.append(as_openai(message, self.format, self.tools))

    @property
    def malformed(self) -> int:
        return self.episode.malformed + self.invalid

    async def lease(self) -> None:
        """Wait for the sandbox being created (``SandboxFailed`` if that failed)."""
        if self.creating is not None:
            pending, self.creating = self.creating, None
            try:
                self.sandbox = await pending
            except RemoteError as e:
                raise SandboxFailed(e) from None

    # --- the loop ------------------------------------------------------------

    async def run(self) -> c.Trajectory | c.PartialSample | Stale:
        try:
            return await self._run()
        except SandboxFailed as e:
            failed = self.trajectory(c.TrajectoryStatus.INFRA_ERROR, "error", infra_error=f"sandbox create failed: {e}")
            return failed.model_copy(update={"infra_code": e.error.code, "sandbox": None})

    async def _run(self) -> c.Trajectory | c.PartialSample | Stale:
        spec, s, ep = self.spec, self.settings, self.episode
        if self.creating is None and self.sandbox is None:
            return self.trajectory(c.TrajectoryStatus.INFRA_ERROR, "error", infra_error="sandbox lost while suspended")
        finish = "max_turns"
        while self.turns < s.max_turns:
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
                await self.lease()
                return Stale(
                    spec.sample_index,
                    f"oldest token is {self.engine.version - oldest} versions old (max {spec.max_staleness})",
                    self.sandbox,
                )
            if self.suspend is not None and self.suspend.is_set():
                return await self.suspended()
            with self.tracer.start_as_current_span(
                "rollout.generate", attributes={"turn": self.turns, "resumed_tokens": ep.pending_tokens()}
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
            self.turns += 1
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
                return self.trajectory(
                    c.TrajectoryStatus.INFRA_ERROR, "error", infra_error=f"tool execution failed: {e}"
                )
            for p in parsed:
                self.add(
                    c.ChatMessage(
                        role="tool", content=clip_text(results[p.id], s.max_observation_chars), tool_call_id=p.id
                    )
                )
        ep.finish(close=True)  # the last turn closes the way the chat template closes it
        await self.lease()
        try:  # the final workspace as a diff: reward can rebuild it if the sandbox is lost
            final_diff = await self.envpool.diff(self.sandbox)
        except RemoteError as e:
            self.sandbox = None
            return self.trajectory(c.TrajectoryStatus.INFRA_ERROR, "error", infra_error=f"sandbox lost: {e}")
        return self.trajectory(c.TrajectoryStatus.FINISHED, finish, final_diff=final_diff)

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
                self.invalid += 1
                continue
            valid.append(c.ToolCall(id=p.id, name=p.name, arguments=p.arguments))
        if valid:
            await self.lease()
            with self.tracer.start_as_current_span("rollout.tools", attributes={"calls": len(valid)}):
                for r in await self.envpool.tools(self.sandbox, valid, timeout_s=self.settings.tool_timeout_s):
                    results[r.call_id] = json.dumps({"error": r.error}) if r.error else r.output
        return results

    async def suspended(self) -> c.PartialSample:
        await self.lease()
        seq, turn_tokens, state = self.episode.snapshot()
        return c.PartialSample(
            sample_index=self.spec.sample_index,
            token_ids=seq.ids,
            logprobs=seq.logprobs,
            token_versions=seq.versions,
            loss_mask=seq.mask,
            messages=self.messages,
            num_turns=self.turns,
            turn_tokens=turn_tokens,
            malformed_tool_calls=self.malformed,
            sandbox=self.sandbox,
            started_at=self.started_at,
            worker_id=self.spec.worker_id,
            episode=state,
        )

    def trajectory(
        self,
        status: c.TrajectoryStatus,
        finish: str,
        *,
        infra_error: str | None = None,
        final_diff: c.SandboxDiff | None = None,
    ) -> c.Trajectory:
        req, ep = self.spec.request, self.episode
        if status is not c.TrajectoryStatus.FINISHED:
            ep.finish()
        s = ep.seq
        return c.Trajectory(
            run_id=req.run_id,
            trajectory_id=self.trajectory_id,
            group_id=req.group_id,
            task_id=req.task_id,
            sample_index=self.spec.sample_index,
            dispatch_version=req.dispatch_version,
            worker_id=self.spec.worker_id,
            started_at=self.started_at,
            status=status,
            infra_error=infra_error,
            messages=self.messages,
            token_ids=s.ids,
            logprobs=s.logprobs,
            token_versions=s.versions,
            loss_mask=s.mask,
            num_turns=self.turns,
            malformed_tool_calls=self.malformed,
            finish_reason=finish,
            sandbox=self.sandbox,
            final_diff=final_diff,
            segments=ep.segments,
            finished_at=time.time(),
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
    loop = AgentLoop(spec, engine, tokenizer, envpool, settings, tracer, suspend)
    if resume is None:
        loop.start()
    else:
        loop.restore(resume)
    return await loop.run()
