"""One sample's lifecycle, whichever harness plays it.

A *sample* is one episode of one task for one group. ``SampleLifecycle`` owns everything
about it that does not depend on who plays it: the sandbox lease and its TTL, the
``Budget``, the ``Episode`` that records its tokens, the final diff or the destroy, and
the one ``Trajectory``. A *harness* only plays: kiln's own loop (``agent.BuiltinHarness``)
and the external harnesses behind the OpenAI-compatible endpoint
(``harness.external.ExternalHarness``) implement the same small ``Harness`` interface
side by side (the shape of SkyRL's ``GeneratorInterface``), and the worker and the
evaluator run every sample through ``SampleLifecycle.run``, never a harness's own setup.

Invariants:
- every sample played to its end yields exactly one result: one ``Trajectory``, or a ``PartialSample``
  (suspended: an APRIL abort) or a ``Stale`` (too old to continue) that the worker
  carries on or abandons; the ``Trajectory`` is assembled here and nowhere else;
- every sandbox leased for a sample ends exactly one way: its diff taken and the sandbox
  handed to reward in the ``Trajectory`` (reward destroys it once scored); destroyed here
  (a sample that is not scored from it: a failed harness, an infrastructure error, a
  lost sandbox; best effort, its lease ends it otherwise); or carried in the
  ``PartialSample`` or ``Stale`` to the worker, which resumes or destroys it. A sandbox
  whose creation failed is none of these: the sample is ``infra_error`` with env-pool's
  code and no sandbox; a sample cut short by an exception (a dead engine, cancellation)
  yields nothing and leaves its sandbox to its lease;
- the lease runs to the group's deadline plus reward's scoring time
  (``sandbox_score_buffer_s``), at least one second before that buffer, so a request
  dispatched late never gets a zero lease;
- one budget for every harness, from the rollout settings: ``max_total_tokens`` bounds
  the tokens generated and the context (prompt plus completion) of each call,
  ``max_new_tokens`` each call's completion, ``max_turns`` the calls, the group's
  deadline all of them (``Episode`` enforces it whatever the harness does);
- the sandbox's creation starts before the harness plays and is awaited only where the
  harness first needs it (``SampleContext.sandbox``), so provisioning overlaps the first
  generation of a harness that can start without it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tokenizers import Tokenizer

from kiln.rollout.config import RolloutSettings
from kiln.rollout.engine import InferenceEngine
from kiln.rollout.episode import Budget, Episode
from kiln.shared import contracts as c
from kiln.shared.bus import RemoteError
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.tasks import Task
from kiln.shared.toolformats import tool_format


@dataclass
class EpisodeSpec:
    """What one sample is: the request, which sample of its group, the task and how to sample."""

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
    """A sample whose oldest generated token is too many versions old to continue."""

    sample_index: int
    detail: str
    sandbox: c.SandboxRef | None


class SandboxFailed(Exception):
    """The sandbox could not be created: the sample ends as an infrastructure error."""

    def __init__(self, error: RemoteError):
        super().__init__(str(error))
        self.error = error

    def played(self) -> Played:
        return Played("error", scored=False, infra_error=f"sandbox create failed: {self}", infra_code=self.error.code)


@dataclass
class Played:
    """How a harness's play of a sample ended (the lifecycle makes the ``Trajectory`` of it)."""

    finish: str
    """The trajectory's ``finish_reason``."""
    scored: bool = True
    """True: the sample is scored from its sandbox (the lifecycle takes its diff); False:
    nothing is (a failed harness, an infrastructure error) and the sandbox is destroyed."""
    infra_error: str | None = None
    """kiln's own machinery failed (or a failed harness is masked): status ``infra_error``."""
    infra_code: str | None = None
    """env-pool's code for the error (``environment_error``: the task cannot be built)."""
    log: str = ""
    """The tail of an external harness's own output."""


@dataclass
class SampleContext:
    """What a harness plays a sample with, and the record of it the harness keeps current
    (``messages``, ``turns``, ``invalid``: the trajectory records them besides the tokens)."""

    spec: EpisodeSpec
    settings: RolloutSettings
    engine: InferenceEngine
    envpool: EnvPoolClient
    episode: Episode
    suspend: asyncio.Event | None
    """Set by an abort (APRIL): a harness that ``suspends`` stops and returns a ``PartialSample``."""
    resumed: bool
    """Restored from a ``PartialSample``: ``episode`` and the record continue it."""
    started_at: float
    messages: list[c.ChatMessage] = field(default_factory=list)
    turns: int = 0
    invalid: int = 0
    """Calls that parsed but the harness refused (unknown tool, bad arguments); the
    episode counts those that did not parse."""
    leased: c.SandboxRef | None = None
    """The sandbox, once created (``sandbox()``)."""
    creating: asyncio.Task | None = None

    @property
    def trajectory_id(self) -> str:
        return self.episode.id

    @property
    def malformed(self) -> int:
        return self.episode.malformed + self.invalid

    async def sandbox(self) -> c.SandboxRef:
        """The sample's sandbox, waiting for its creation (``SandboxFailed`` if that failed)."""
        if self.creating is not None:
            pending, self.creating = self.creating, None
            try:
                self.leased = await pending
            except RemoteError as e:
                raise SandboxFailed(e) from None
        assert self.leased is not None, "a sample always has a sandbox or its creation"
        return self.leased


class Harness(Protocol):
    """One way of playing a sample: kiln's own loop or an external harness."""

    suspends: bool
    """True: an abort suspends the sample (``play`` returns a ``PartialSample``; its
    episode has no ``wait_resume``); False: an aborted generation waits inside its call
    for the new version (``wait_resume``) and the harness sees latency only."""

    async def play(self, sample: SampleContext) -> Played | c.PartialSample | Stale:
        """Play the sample to its end through ``sample.episode``, keeping its record
        current. ``SandboxFailed`` (from ``sample.sandbox()``) may propagate."""
        ...


class SampleLifecycle:
    """One sample from lease to ``Trajectory`` (or suspension), whatever harness plays it."""

    def __init__(
        self,
        spec: EpisodeSpec,
        harness: Harness,
        engine: InferenceEngine,
        tokenizer: Tokenizer,
        envpool: EnvPoolClient,
        settings: RolloutSettings,
        *,
        suspend: asyncio.Event | None = None,
        wait_resume: Callable[[], Awaitable[None]] | None = None,
        resume: c.PartialSample | None = None,
    ):
        self.spec, self.harness, self.envpool, self.settings = spec, harness, envpool, settings
        self.resume = resume
        req = spec.request
        episode = Episode(
            f"{req.group_id}-s{spec.sample_index}",
            engine,
            tokenizer,
            tool_format(settings.harness.tool_format),
            self.budget(settings, req.deadline),
            seed=spec.seed,
            temperature=spec.temperature,
            wait_resume=None if harness.suspends else wait_resume,
        )
        self.sample = SampleContext(
            spec, settings, engine, envpool, episode, suspend, resumed=resume is not None, started_at=time.time()
        )

    @staticmethod
    def budget(settings: RolloutSettings, deadline: float) -> Budget:
        """The one budget of every sample, whichever harness plays it."""
        return Budget(
            max_generated_tokens=settings.max_total_tokens,
            max_calls=settings.max_turns,
            deadline=deadline,
            max_tokens_per_call=settings.max_new_tokens,
            max_context_tokens=settings.max_total_tokens,
        )

    def lease_ttl(self) -> float:
        # Leased to the group's deadline (after which the controller drops the group) plus the
        # scoring time reward needs; the floor keeps a request dispatched late from a zero lease.
        return max(self.spec.request.deadline - time.time(), 1.0) + self.settings.sandbox_score_buffer_s

    def begin(self) -> None:
        """Start the sandbox's creation, or continue a suspended sample in its own sandbox.
        Nothing here awaits: the harness's first generation overlaps the creation."""
        s, p = self.sample, self.resume
        if p is None:
            req = self.spec.request
            s.creating = asyncio.create_task(
                self.envpool.create(self.spec.task.id, run_id=req.run_id, ttl_s=self.lease_ttl())
            )
            return
        s.episode.restore(p)
        s.messages, s.turns, s.leased, s.started_at = list(p.messages), p.num_turns, p.sandbox, p.started_at
        s.invalid = p.malformed_tool_calls - s.episode.malformed

    async def run(self) -> c.Trajectory | c.PartialSample | Stale:
        self.begin()
        s = self.sample
        if s.resumed and s.leased is None:
            return await self.end(Played("error", scored=False, infra_error="sandbox lost while suspended"))
        try:
            out = await self.harness.play(s)
        except SandboxFailed as e:
            return await self.end(e.played())
        if isinstance(out, Played):
            return await self.end(out)
        return out

    async def end(self, played: Played) -> c.Trajectory:
        """The final diff or the destroy, then the sample's one ``Trajectory``."""
        s = self.sample
        s.episode.finish()  # a completion no later call kept, or an open call's tokens, end the trajectory
        if s.creating is not None:  # the harness ended before it needed its sandbox
            try:
                await s.sandbox()
            except SandboxFailed as e:
                played = e.played()
        sandbox, final_diff = s.leased, None
        if sandbox is not None and played.scored:
            try:  # the final workspace as a diff: reward can rebuild it if the sandbox is lost
                final_diff = await self.envpool.diff(sandbox)
            except RemoteError as e:
                played = Played("error", scored=False, infra_error=f"sandbox lost: {e}", log=played.log)
        if sandbox is not None and not played.scored:
            try:  # nothing is scored from it: leave no sandbox behind
                await self.envpool.destroy(sandbox)
            except RemoteError:
                pass  # its lease ends it
            sandbox = None
        return self.trajectory(played, sandbox, final_diff)

    def trajectory(
        self, played: Played, sandbox: c.SandboxRef | None, final_diff: c.WorkspaceDiff | None
    ) -> c.Trajectory:
        req, s, ep = self.spec.request, self.sample, self.sample.episode
        seq = ep.seq
        return c.Trajectory(
            run_id=req.run_id,
            trajectory_id=s.trajectory_id,
            group_id=req.group_id,
            task_id=req.task_id,
            sample_index=self.spec.sample_index,
            dispatch_version=req.dispatch_version,
            worker_id=self.spec.worker_id,
            started_at=s.started_at,
            status=c.TrajectoryStatus.FINISHED if played.infra_error is None else c.TrajectoryStatus.INFRA_ERROR,
            infra_error=played.infra_error,
            infra_code=played.infra_code,
            messages=s.messages,
            token_ids=seq.ids,
            logprobs=seq.logprobs,
            token_versions=seq.versions,
            loss_mask=seq.mask,
            num_turns=s.turns,
            malformed_tool_calls=s.malformed,
            finish_reason=played.finish,
            sandbox=sandbox,
            final_diff=final_diff,
            segments=ep.segments,
            harness_log=played.log,
            finished_at=time.time(),
        )
