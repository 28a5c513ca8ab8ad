"""The agent loop: one episode of one task in one sandbox.

generate -> parse tool calls -> env-pool runs them as one batch -> append the
observations -> generate ... until the model answers without a tool call, or a limit
(turns, tokens, deadline) ends the episode.

Invariants of the trajectory it returns:
- ``token_ids`` is exactly what the model conditioned on, in order: generated tokens
  are appended as generated (never re-tokenized), prompt and observation tokens as
  encoded; ``loss_mask`` is 1 only on generated tokens, which alone carry a logprob
  and a policy version;
- a malformed tool call (bad JSON, unknown tool, bad arguments) is answered with an
  ``{"error": ...}`` observation and counted, never raised;
- a failure of the infrastructure (env-pool unreachable, sandbox lost) ends the
  episode with ``status = infra_error`` and the cause, so reward and the learner can
  mask it instead of scoring it 0;
- an episode is resumable: when ``suspend`` is set (an APRIL abort) it stops at once,
  mid-generation or between turns, and returns a ``PartialSample`` holding everything
  sampled so far; ``run_episode(..., resume=partial)`` continues it exactly there, on
  any worker, and the tokens it adds carry the versions that produced them;
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

from kiln.shared import chat
from kiln.shared import contracts as c
from kiln.shared.bus import RemoteError
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.model.tokenizer import special_id
from kiln.shared.tasks import Task
from kiln.shared.tools import ToolCallError, tool_schemas, validate_call

from kiln.rollout.config import RolloutSettings
from kiln.rollout.engine import InferenceEngine
from kiln.rollout.tokens import Sequence

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


def clip_text(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


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
    req, task = spec.request, spec.task
    eos = special_id(tokenizer, chat.EOS)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False).ids  # noqa: E731
    seq = Sequence()
    traj = dict(
        run_id=req.run_id,
        trajectory_id=f"{req.group_id}-s{spec.sample_index}",
        group_id=req.group_id,
        task_id=req.task_id,
        sample_index=spec.sample_index,
        dispatch_version=req.dispatch_version,
        worker_id=spec.worker_id,
        started_at=time.time(),
    )
    turn_ids: list[int] = []  # generated tokens of the open assistant turn
    if resume is None:
        system = chat.SYSTEM_PROMPT
        messages = [c.ChatMessage(role="system", content=system), c.ChatMessage(role="user", content=task.problem_statement)]
        seq.context(enc(chat.render_system(system, tool_schemas(spec.tools)) + chat.render_user(task.problem_statement) + chat.assistant_prefix()))
        malformed = turns = 0
        sandbox = None
        # Leased to the group's deadline (after which the controller drops the group) plus the
        # scoring time reward needs; the floor keeps a request dispatched late from a zero lease.
        ttl = max(req.deadline - time.time(), 1.0) + settings.sandbox_score_buffer_s
        creating = asyncio.create_task(envpool.create(task.id, run_id=req.run_id, ttl_s=ttl))
    else:
        creating = None
        seq.ids, seq.logprobs = list(resume.token_ids), list(resume.logprobs)
        seq.versions, seq.mask = list(resume.token_versions), list(resume.loss_mask)
        messages = list(resume.messages)
        malformed, turns, sandbox = resume.malformed_tool_calls, resume.num_turns, resume.sandbox
        turn_ids = seq.ids[len(seq.ids) - resume.turn_tokens :] if resume.turn_tokens else []
        traj["started_at"] = resume.started_at
        if sandbox is None:
            return _finish(traj, seq, messages, c.TrajectoryStatus.INFRA_ERROR, "sandbox lost while suspended", turns, malformed, "error", None)

    async def lease() -> c.Trajectory | None:
        """Wait for the sandbox being created; the infra-error trajectory if that failed."""
        nonlocal sandbox, creating
        if creating is not None:
            pending, creating = creating, None
            try:
                sandbox = await pending
            except RemoteError as e:
                failed = _finish(traj, seq, messages, c.TrajectoryStatus.INFRA_ERROR, f"sandbox create failed: {e}", turns, malformed, "error", None)
                return failed.model_copy(update={"infra_code": e.code})
        return None

    async def suspended() -> c.PartialSample | c.Trajectory:
        if failed := await lease():
            return failed
        return c.PartialSample(
            sample_index=spec.sample_index, token_ids=seq.ids, logprobs=seq.logprobs, token_versions=seq.versions,
            loss_mask=seq.mask, messages=messages, num_turns=turns, turn_tokens=len(turn_ids),
            malformed_tool_calls=malformed, sandbox=sandbox, started_at=traj["started_at"], worker_id=spec.worker_id,
        )  # fmt: skip

    finish = "max_turns"
    while turns < settings.max_turns:
        budget = min(settings.max_new_tokens - len(turn_ids), settings.max_total_tokens - len(seq.ids) - 1)
        if budget <= 0 and not turn_ids:
            finish = "max_tokens"
            break
        if time.time() > req.deadline:
            finish = "deadline"
            break
        oldest = seq.oldest()
        if spec.max_staleness is not None and oldest is not None and engine.version - oldest > spec.max_staleness:
            if failed := await lease():
                return failed
            return Stale(spec.sample_index, f"oldest token is {engine.version - oldest} versions old (max {spec.max_staleness})", sandbox)
        if suspend is not None and suspend.is_set():
            return await suspended()
        if budget > 0:
            with tracer.start_as_current_span("rollout.generate", attributes={"turn": turns, "resumed_tokens": len(turn_ids)}) as span:
                gen = await engine.generate(seq.ids, budget, {eos}, spec.temperature, spec.seed * 1000 + turns * 37 + len(turn_ids))
                span.set_attribute("policy.version", gen.version)
                span.set_attribute("tokens", len(gen.token_ids))
                span.set_attribute("finish_reason", gen.finish_reason)
            seq.generated(gen.token_ids, gen.logprobs, gen.versions)
            turn_ids += gen.token_ids
            if gen.finish_reason == "abort":
                return await suspended()
            stopped = gen.finish_reason == "stop"
        else:
            stopped = False  # the turn's budget was spent before a suspension
        turns += 1
        text_ids = turn_ids[:-1] if stopped else turn_ids
        text = tokenizer.decode(text_ids, skip_special_tokens=False)
        turn_version = seq.versions[-1] if turn_ids else engine.version
        turn_ids = []
        # Close the turn the way the chat template does; only generated tokens are trained.
        seq.context(enc("\n") if stopped else [eos] + enc("\n"))
        parsed = chat.parse_tool_calls(text)
        messages.append(
            c.ChatMessage(
                role="assistant",
                content=text,
                version=turn_version,
                tool_calls=[c.ToolCall(id=p.id, name=p.name or "?", arguments=p.arguments if isinstance(p.arguments, dict) else {}) for p in parsed],
            )
        )
        if not parsed:
            finish = "no_tool_call"
            break
        results: dict[str, str] = {}
        valid: list[c.ToolCall] = []
        for p in parsed:
            if p.error:
                results[p.id] = json.dumps({"error": p.error})
                malformed += 1
                continue
            try:
                validate_call(p.name, p.arguments, spec.tools)
            except ToolCallError as e:
                results[p.id] = json.dumps({"error": str(e)})
                malformed += 1
                continue
            valid.append(c.ToolCall(id=p.id, name=p.name, arguments=p.arguments))
        if valid:
            if failed := await lease():
                return failed
            try:
                with tracer.start_as_current_span("rollout.tools", attributes={"calls": len(valid)}):
                    for r in await envpool.tools(sandbox, valid, timeout_s=settings.tool_timeout_s):
                        results[r.call_id] = json.dumps({"error": r.error}) if r.error else r.output
            except RemoteError as e:
                return _finish(
                    traj, seq, messages, c.TrajectoryStatus.INFRA_ERROR, f"tool execution failed: {e}", turns, malformed, "error", sandbox
                )
        ordered = [clip_text(results[p.id], settings.max_observation_chars) for p in parsed]
        for p, r in zip(parsed, ordered):
            messages.append(c.ChatMessage(role="tool", content=r, tool_call_id=p.id))
        seq.context(enc(chat.render_tool_results(ordered) + chat.assistant_prefix()))
    if failed := await lease():
        return failed
    try:  # the final workspace as a diff: reward can rebuild it if the sandbox is lost
        final_diff = await envpool.diff(sandbox)
    except RemoteError as e:
        return _finish(traj, seq, messages, c.TrajectoryStatus.INFRA_ERROR, f"sandbox lost: {e}", turns, malformed, "error", None)
    return _finish(traj, seq, messages, c.TrajectoryStatus.FINISHED, None, turns, malformed, finish, sandbox, final_diff)


def _finish(traj, seq: Sequence, messages, status, infra_error, turns, malformed, finish, sandbox, final_diff=None) -> c.Trajectory:
    return c.Trajectory(
        **traj,
        status=status,
        infra_error=infra_error,
        messages=messages,
        token_ids=seq.ids,
        logprobs=seq.logprobs,
        token_versions=seq.versions,
        loss_mask=seq.mask,
        num_turns=turns,
        malformed_tool_calls=malformed,
        finish_reason=finish,
        sandbox=sandbox,
        final_diff=final_diff,
        finished_at=time.time(),
    )
