"""Message schemas of the run: rollout work, trajectories, scores, policy versions, metrics.

Part of ``kiln.shared.contracts`` (import them from there); every message derives from
``Message``: strict (unknown fields refused), versioned (``schema``), JSON on the wire.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1


class Message(BaseModel):
    """Base of every message on the bus: strict, versioned, JSON on the wire."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=False)

    schema_: Literal[1] = Field(default=SCHEMA_VERSION, alias="schema")
    """Schema version of this message; receivers reject versions they do not know."""

    def to_bytes(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes):
        return cls.model_validate_json(data)


MAX_GROUP_SAMPLES = 1024
"""The most samples one message may ask for: a worker runs a group's samples at once, so
an unbounded count in one message could exhaust its memory."""


class RolloutRequest(Message):
    """One group of ``n_samples`` rollouts of one task, all started from the same policy version."""

    run_id: str
    group_id: str
    task_id: str
    n_samples: int = Field(ge=1, le=MAX_GROUP_SAMPLES)
    dispatch_version: int = Field(ge=0)
    """Policy version the controller dispatched this group for; workers serve at least it."""
    deadline: float = Field(allow_inf_nan=False)
    """Unix time after which the controller drops the group (reason ``deadline``). Finite:
    a NaN made every sample's sandbox lease NaN, retried until dead-lettered."""
    sample_traces: list[str] = Field(default_factory=list)
    """W3C ``traceparent`` per sample: every trajectory is its own trace, rooted at dispatch."""
    samples: list[int] | None = None
    """Sample indices still to run (a resumed group); None = all ``n_samples``."""
    partials: list[PartialSample] = Field(default_factory=list)
    """Suspended samples to continue where they stopped; samples in ``samples`` without
    one start from scratch."""
    suspensions: int = 0
    """How many times this group has been suspended (part of its resume message id)."""
    resume_version: int = 0
    """A resumed group runs only on a worker serving at least this version (the one whose
    batch filled when it was suspended)."""

    @model_validator(mode="after")
    def _traces_match_samples(self) -> RolloutRequest:
        if self.sample_traces and len(self.sample_traces) != self.n_samples:
            raise ValueError("sample_traces must have one entry per sample")
        if self.samples is not None and any(not 0 <= i < self.n_samples for i in self.samples):
            raise ValueError(f"samples must be indices below n_samples ({self.n_samples})")
        if any(not 0 <= p.sample_index < self.n_samples for p in self.partials):
            raise ValueError(f"partials must be of samples below n_samples ({self.n_samples})")
        return self


class ToolCall(Message):
    """One tool call as parsed from the model's output."""

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolResult(Message):
    call_id: str
    name: str
    output: str = ""
    error: str | None = None
    """Set when the call failed; the model sees ``{"error": ...}`` as its observation."""


class ChatMessage(Message):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    version: int | None = None
    """Policy version that generated an assistant message (the last one, if it spans several)."""


class SandboxRef(Message):
    node_id: str
    sandbox_id: str
    boot: str = ""
    """The env-pool process that made it (``NodeStats.boot``): a node restarted under the
    same id has another, and none of its predecessor's sandboxes. Empty: unknown."""


class SandboxDiff(Message):
    """What changed in a sandbox's workspace since it was created from its task."""

    sandbox_id: str


class WorkspaceDiff(Message):
    """File-level changes against the task's files: enough to rebuild the final workspace
    in a fresh sandbox (reward does, when the trajectory's own sandbox is gone)."""

    changed: dict[str, str] = Field(default_factory=dict)
    """Path -> new text of every added or modified text file."""
    deleted: list[str] = Field(default_factory=list)
    binary: list[str] = Field(default_factory=list)
    """Added or modified files that are not text or are too large, links, and mode changes
    (not carried as text; ``patch`` has them)."""
    patch: str = ""
    """The same changes as a git-style patch against the task's start (renames, modes and
    binary files included; ``git apply`` takes it), cut past 1 MiB."""
    patch_left_out: list[str] = Field(default_factory=list)
    """Changed files left out of ``patch`` (over 1 MiB each, or past the number of files
    one patch shows)."""
    omitted: list[str] = Field(default_factory=list)
    """Folders and files the diff did not walk into, not carried: deeper than its depth
    bound or with a path longer than its length bound (env-pool's ``diff_max_depth``,
    ``diff_max_path_chars``)."""
    truncated: str = ""
    """Why the diff is incomplete (more changed entries than one diff carries:
    ``diff_max_files``); empty when it is whole. A truncated diff cannot rebuild the
    workspace, so reward scores it ``not_applied``."""


class TrajectoryStatus(str, Enum):
    FINISHED = "finished"
    INFRA_ERROR = "infra_error"


class Segment(Message):
    """Where a trajectory restarts: the tokens from ``start`` on train as a sequence of
    their own (a harness rewrote its history, so they do not extend the ones before)."""

    start: int
    reason: str


class Trajectory(Message):
    """A whole agent episode. Token arrays are parallel: ``token_ids[i]`` was produced
    with ``logprobs[i]`` under policy ``token_versions[i]`` when ``loss_mask[i]`` is 1;
    prompt and observation tokens have mask 0, logprob 0 and version -1."""

    run_id: str
    trajectory_id: str
    group_id: str
    task_id: str
    sample_index: int
    dispatch_version: int
    status: TrajectoryStatus
    infra_error: str | None = None
    infra_code: str | None = None
    """The infra error's cause as a code (env-pool's error code, e.g. ``environment_error``:
    the task's environment cannot be built, so the controller sets its tasks aside)."""
    messages: list[ChatMessage] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    token_versions: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    num_turns: int = 0
    malformed_tool_calls: int = 0
    finish_reason: str = ""
    """Why the episode ended: ``no_tool_call``, ``max_turns``, ``max_tokens``, ``deadline``,
    ``error``; for an external harness also ``harness_done``, ``harness_error`` and
    ``timeout`` (the last two score 0 by default: ``HARNESS_FAILURES``)."""
    sandbox: SandboxRef | None = None
    """The sandbox holding the final workspace (reward destroys it once scored)."""
    final_diff: WorkspaceDiff | None = None
    """The final workspace as changes to the task's files: what reward scores, in a clean room."""
    segments: list[Segment] = Field(default_factory=list)
    """Restarts of the token sequence (an external harness rewrote its history): each
    ``start`` opens a sequence that trains on its own; empty: one sequence."""
    harness_log: str = ""
    """The tail of an external harness's own output (why it failed, for people)."""
    worker_id: str = ""
    started_at: float = Field(default_factory=time.time)
    finished_at: float = Field(default_factory=time.time)
    purpose: Literal["train", "eval"] = "train"
    """``eval``: an evaluation episode; reward sends its score to ``kiln.eval.scored``."""
    eval_id: str = ""
    """The evaluation it belongs to (``purpose = eval``)."""

    @model_validator(mode="after")
    def _parallel_arrays(self) -> Trajectory:
        n = len(self.token_ids)
        if not (len(self.logprobs) == len(self.token_versions) == len(self.loss_mask) == n):
            raise ValueError("token_ids, logprobs, token_versions and loss_mask must have equal length")
        starts = [s.start for s in self.segments]
        if starts != sorted(set(starts)) or any(not 0 < x < n for x in starts):
            raise ValueError("segment starts must be increasing offsets inside the token sequence")
        return self

    def sequences(self) -> list[slice]:
        """The token ranges that train as sequences of their own (one without segments)."""
        bounds = [0, *(s.start for s in self.segments), len(self.token_ids)]
        return [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def generated_versions(self) -> list[int]:
        return [v for v, m in zip(self.token_versions, self.loss_mask) if m]


class KeptCompletion(Message):
    """A completion an episode generated, kept to write its exact tokens wherever a later
    call's messages repeat it (``kiln.rollout.episode``)."""

    key: str
    """What identifies it in a request's messages: its prose and its calls."""
    stopped: bool
    """Ended by the stop token (which its tokens include)."""
    at: int | None = None
    """Offset of its generated tokens in the sample's ``token_ids``; None: not part of the
    trajectory yet, its tokens are the fields below."""
    length: int
    ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    versions: list[int] = Field(default_factory=list)


class OpenCall(Message):
    """A call whose prompt is in the trajectory and whose generation is not finished (its
    tokens so far are the sample's last ``turn_tokens``)."""

    prompt_start: int
    """Where its prompt begins in ``token_ids`` (the start of its segment)."""
    extended: bool
    max_tokens: int | None = None
    temperature: float | None = None


class EpisodeState(Message):
    """What an episode (``kiln.rollout.episode.Episode``) needs, beyond the token arrays,
    to continue on another worker exactly where it stopped."""

    segments: list[Segment] = Field(default_factory=list)
    calls: int = 0
    """Calls finished."""
    generated_tokens: int = 0
    malformed: int = 0
    """Tool calls that did not parse."""
    completions: list[KeptCompletion] = Field(default_factory=list)
    open_call: OpenCall | None = None


class PartialSample(Message):
    """A sample suspended mid-episode (APRIL): everything needed to continue it on any
    worker. Token arrays are parallel as in ``Trajectory``; ``turn_tokens`` generated
    tokens of the open assistant turn (already in ``token_ids``)."""

    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    loss_mask: list[int]
    messages: list[ChatMessage]
    num_turns: int
    """Completed assistant turns."""
    turn_tokens: int = 0
    malformed_tool_calls: int = 0
    sandbox: SandboxRef | None = None
    """The sample's sandbox, still leased; None once lost (the resume fails the sample as
    an infrastructure error)."""
    started_at: float
    worker_id: str = ""
    episode: EpisodeState | None = None
    """The episode's own state (segments, kept completions, the open call); None in a
    sample suspended by a worker from before it existed: it resumes with no kept
    completions, so its next call opens a new segment."""

    def oldest_version(self) -> int | None:
        gen = [v for v, m in zip(self.token_versions, self.loss_mask) if m]
        return min(gen) if gen else None


class CaseStatus(str, Enum):
    """Outcome of one test case of a task."""

    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    SKIPPED = "skipped"
    MISSING = "missing"


class Failure(str, Enum):
    """Why a scored (not infra-errored) trajectory did not pass; each scores like a failing
    test run. Anything the workspace's content causes is one of these, never ``infra_error``."""

    TESTS_FAILED = "tests_failed"
    """The runner's report is complete and some FAIL_TO_PASS or PASS_TO_PASS test did not pass."""
    TAMPERED = "tampered"
    """The tested code replaced an entry point of the test framework or of kiln's collector."""
    TIMEOUT = "timeout"
    """The test run passed the task's timeout and was killed."""
    INCOMPLETE = "incomplete"
    """The test process ended (exited, crashed, was killed) before its run finished."""
    NO_REPORT = "no_report"
    """The runner left no valid report, while it does on the task's pristine repository."""
    NOT_APPLIED = "not_applied"
    """The trajectory's changes could not be written into the clean room (quota, a file
    where a folder must be, ...)."""
    PROTECTED = "protected"
    """The trajectory changed protected files and the task makes that cost the reward."""
    HARNESS = "harness"
    """The external harness crashed or outlived its episode (``HARNESS_FAILURES``)."""


HARNESS_FAILURES = ("harness_error", "timeout")
"""``Trajectory.finish_reason`` of an external harness that crashed or outlived its
episode: scored 0 by reward (failure ``harness``) unless the suite masks them."""


class Integrity(Message):
    """What the clean room found about a trajectory beyond its tests' statuses."""

    protected: dict[str, str] = Field(default_factory=dict)
    """Paths of the diff that touched protected files (reverted before the run) -> why."""
    tampered: list[str] = Field(default_factory=list)
    """Framework entry points the tested code replaced (``unittest.TestCase.run``, ...)."""
    shadowed: list[str] = Field(default_factory=list)
    """Standard-library modules the workspace's own modules stood in for (a finding)."""
    not_reproduced: list[str] = Field(default_factory=list)
    """Changes the diff does not carry as text (links, binaries, modes, too large): absent
    from the clean room."""


class ScoredTrajectory(Message):
    trajectory: Trajectory
    reward: float
    passed: bool
    """All FAIL_TO_PASS and PASS_TO_PASS tests passed."""
    tests: dict[str, CaseStatus] = Field(default_factory=dict)
    reward_terms: dict[str, float] = Field(default_factory=dict)
    """Each term of ``reward`` (``tests`` and any shaping terms); ``reward`` is their sum."""
    rescored_from_diff: bool = False
    """The tests ran in a fresh sandbox with the trajectory's diff applied (always, since
    reward scores in a clean room: docs/reward.md)."""
    infra_error: str | None = None
    """Set when kiln's own machinery could not score (a lost sandbox, a dead node, the
    runner failing on the task's pristine repository): the learner masks the trajectory
    out, never scores it 0."""
    failure: Failure | None = None
    """Why it did not pass (None: it passed, or ``infra_error``)."""
    failure_detail: str = ""
    integrity: Integrity = Field(default_factory=Integrity)
    report: dict[str, Any] | None = None
    """The runner's structured report (``kiln.shared.tasks.testrun.RunnerReport``)."""
    test_output: str = ""
    """What the tests printed, for people (never read for the score)."""
    scored_at: float = Field(default_factory=time.time)


class TensorInfo(Message):
    file: str
    dtype: str
    shape: list[int]


class FileInfo(Message):
    path: str
    size: int
    sha256: str
    chunk: int = 0
    """Bytes per chunk of ``chunks`` (0: no chunk digests, e.g. a manifest written before
    they existed; such a file verifies by its whole ``sha256``)."""
    chunks: list[str] = Field(default_factory=list)
    """sha256 of each ``chunk`` bytes of the file, in order (the last one shorter): a
    receiver that patched some blocks of a verified base re-hashes only their chunks."""


class WeightsManifest(Message):
    """Everything a receiver needs to fetch and verify a policy version."""

    run_id: str
    version: int
    step: int
    parent_version: int | None
    files: list[FileInfo]
    tensors: dict[str, TensorInfo]
    storage: Literal["full", "delta"] = "full"
    """``full``: the store holds this version's files; ``delta``: only its delta against
    ``base_version`` (rebuild from the nearest full version before it)."""
    base_version: int | None = None
    delta: FileInfo | None = None
    """The delta blob (``delta.kd``) when ``storage`` is ``delta``."""
    created_at: float = Field(default_factory=time.time)


class PolicyCheckpoint(Message):
    """Learner -> weights: parameters of ``version`` staged as an HF-format folder at ``path``."""

    run_id: str
    version: int
    step: int
    parent_version: int | None
    path: str
    files: list[FileInfo] = Field(default_factory=list)
    """Size and sha256 of every staged file, computed by the learner that wrote them
    (``kiln.shared.weights.manifest.file_infos``): the weights service builds the manifest
    from these instead of hashing the folder again, and receivers verify against them, so
    a version is hashed once at its source and once per copy that is served. Empty: the
    weights service hashes the folder itself."""
    trace_id: str = ""


class WeightsPublished(Message):
    run_id: str
    version: int
    step: int
    path: str
    """Directory of the stored version in the weights store (for receivers that share its disk)."""
    manifest: WeightsManifest
    manifest_sha256: str
    url: str = ""
    """Base URL of the weights service's HTTP API (for receivers that do not share the disk)."""
    broadcast: bool = False
    """The weights service sends this version over its broadcast group right after this
    event (its group had formed): ``vllm-nccl`` engines post their receive for it; the
    others fetch its files."""


class GroupDropped(Message):
    run_id: str
    group_id: str
    reason: Literal["stale", "infra_error", "deadline", "invalid", "run_finished", "no_signal"]
    """``no_signal``: every sample of the group scored alike (``algorithm.uniform_group_retries``)."""
    detail: str = ""


class StepMetrics(Message):
    run_id: str
    step: int
    version: int
    """The policy version this step produced."""
    groups: int
    trajectories: int
    mean_reward: float
    pass_rate: float
    loss: float
    infra_errors: int
    dropped_groups: int
    mean_staleness: float
    max_staleness: int
    step_seconds: float
    wait_seconds: float
    """Time the learner waited for a full batch before this step (its idle time)."""
    tokens: int
    elapsed_seconds: float
    generated_tokens: int = 0
    """Trained (generated) tokens in the batch."""
    off_policy_tokens: int = 0
    """Of those, tokens sampled by an older policy than the one this step starts from."""
    ratio_mean: float = 0.0
    """Mean importance ratio pi_theta / pi_behaviour over the trained tokens (1 when the
    learner's log-probabilities match the engine's)."""
    clip_frac: float = 0.0
    """Fraction of trained tokens whose ratio the PPO clip cut off."""
    kl: float = 0.0
    """Mean per-token KL estimate to the reference policy (0 without ``kl_coef``)."""
    aux_loss: float = 0.0
    """The MoE load-balancing loss of the step."""
    grad_norm: float = 0.0
    """Global gradient norm before clipping."""
    lr: float = 0.0
    """Learning rate this step applied (after warm-up and decay)."""


class RolloutControl(Message):
    """``abort``: the learner's batch for ``version`` is full; workers suspend what they
    are generating and resume it once they serve ``version`` or later."""

    run_id: str
    kind: Literal["abort"]
    version: int
    at: float = Field(default_factory=time.time)


class GroupAbandoned(Message):
    """A group rollout will not finish (``reason``: ``stale``); the controller drops it."""

    run_id: str
    group_id: str
    reason: str
    detail: str = ""


class EvalRequest(Message):
    """Episodes of one task under exactly one policy version, for an evaluation: greedy
    (``temperature`` 0, one sample) or ``n_samples`` draws for pass@k. Seeds depend on
    ``seed``, the task and the sample only, so every version is measured on the same
    random numbers."""

    run_id: str
    eval_id: str
    weights: WeightsPublished
    """The version to evaluate, as announced (the worker fetches and verifies it)."""
    task_id: str
    mode: Literal["greedy", "sampled"]
    n_samples: int = Field(ge=1, le=MAX_GROUP_SAMPLES)
    temperature: float = Field(ge=0.0)
    seed: int
    deadline: float = Field(allow_inf_nan=False)


class RunEvent(Message):
    run_id: str
    kind: Literal["started", "resumed", "finished", "failed"]
    detail: str = ""
    at: float = Field(default_factory=time.time)


RolloutRequest.model_rebuild()
