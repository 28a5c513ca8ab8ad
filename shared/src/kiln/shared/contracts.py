"""The one place that declares kiln's streams, subjects, consumers and message schemas.

Every service imports its contracts from here and from nowhere else; no service
imports another service. Invariants this module upholds:

- every JetStream subject a service publishes to is captured by exactly one stream
  declared in ``STREAMS`` (``test_contracts`` checks it);
- every message is a pydantic model with a ``schema`` version; a receiver rejects a
  message whose version it does not know (it goes to the dead-letter stream with the
  reason, see ``kiln.shared.bus``);
- ids that identify work (``group_id``, ``trajectory_id``) are deterministic, so a
  redelivered request that republishes its results is deduplicated by
  ``Nats-Msg-Id`` inside the stream's duplicate window.

Large payloads never ride in a message: the bus moves any body above
``NatsSettings.claim_check_bytes`` into the ``kiln-claims`` object store and sends a
reference (claim-check) instead, transparently for both sides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1

# ---------------------------------------------------------------------------
# Subjects
# ---------------------------------------------------------------------------

ROLLOUT_WORK = "kiln.rollout.work"
"""Controller -> rollout workers: one ``RolloutRequest`` per group (work queue)."""
ROLLOUT_RESUME = "kiln.rollout.resume"
"""Rollout -> rollout workers: a suspended group's ``RolloutRequest`` with the partial
samples to resume (work queue; workers take it before any fresh group)."""
ROLLOUT_CONTROL = "kiln.rollout.control"
"""Controller -> every rollout worker: ``RolloutControl`` (``abort``: suspend in-flight
samples now, resume them under the next version)."""
ROLLOUT_ABANDONED = "kiln.rollout.abandoned"
"""Rollout -> controller: ``GroupAbandoned`` for a group a worker will not finish
(stale partials); the controller drops it with the reason (work queue)."""
TRAJECTORY_FINISHED = "kiln.trajectory.finished"
"""Rollout -> reward: one ``Trajectory`` per sample, finished or failed by infrastructure."""
TRAJECTORY_SCORED = "kiln.trajectory.scored"
"""Reward -> learner: one ``ScoredTrajectory`` per trajectory."""
WEIGHTS_CHECKPOINT = "kiln.weights.checkpoint"
"""Learner -> weights: a ``PolicyCheckpoint`` to store and publish (work queue)."""
WEIGHTS_PUBLISHED = "kiln.weights.published"
"""Prefix of ``kiln.weights.published.<run_id>``: ``WeightsPublished`` once a version is
stored and verified. Scoped by run so a late joiner asks for the last message per subject."""
GROUP_DROPPED = "kiln.group.dropped"
"""Learner/controller -> dropped-log: ``GroupDropped`` for every group that will never train."""
STEP_METRICS = "kiln.metrics.step"
"""Learner -> observers: ``StepMetrics`` after every optimizer step."""
RUN_EVENTS = "kiln.run.events"
"""Controller -> observers: ``RunEvent`` when a run starts, finishes or fails."""
EVAL_WORK = "kiln.eval.work"
"""Controller or ``kiln eval`` -> eval workers (rollout, ``role = eval``): one
``EvalRequest`` per task and mode of an evaluation (work queue)."""
EVAL_SCORED = "kiln.eval.scored"
"""Reward -> evaluation collectors: ``ScoredTrajectory`` of an eval trajectory
(``purpose = eval``), never seen by the learner (fan-out: each collector watches it
and keeps the scores of its own evaluations)."""
DEAD_LETTER_PREFIX = "kiln.dlq"
"""``kiln.dlq.<original subject>``: raw bytes of rejected messages, reason in headers."""

ENVPOOL_CREATE = "kiln.envpool.create"
"""Request/reply (queue group ``envpool``): ``SandboxCreate`` -> ``SandboxCreated``."""
ENVPOOL_QUEUE = "envpool"
"""Queue group every env-pool node joins for ``ENVPOOL_CREATE``."""
HEALTH_PREFIX = "kiln.health"
"""``kiln.health.<service>``: request/reply liveness probe answered by every service instance."""


def envpool_node_subject(node_id: str, op: str) -> str:
    """Subject of one env-pool node's own API (``ENVPOOL_NODE_OPS``).

    A sandbox lives on the node that created it, so every call after ``create`` is
    addressed to that node directly instead of to the queue group.
    """
    if op not in ENVPOOL_NODE_OPS:
        raise ValueError(f"unknown env-pool op {op!r}; expected one of {sorted(ENVPOOL_NODE_OPS)}")
    _check_token(node_id)
    return f"kiln.envpool.node.{node_id}.{op}"


ENVPOOL_NODE_OPS = frozenset({"exec", "tools", "destroy", "fork", "snapshot", "renew", "stats", "diff"})


def weights_published_subject(run_id: str) -> str:
    _check_token(run_id)
    return f"{WEIGHTS_PUBLISHED}.{run_id}"


def _check_token(token: str) -> None:
    if not token or any(ch in token for ch in ".*> \t"):
        raise ValueError(f"{token!r} cannot be a subject token (no dots, wildcards or spaces)")


def dead_letter_subject(subject: str) -> str:
    return f"{DEAD_LETTER_PREFIX}.{subject}"


# Header names the bus sets; kept here because consumers of the DLQ read them.
HDR_MSG_ID = "Nats-Msg-Id"
HDR_TYPE = "Kiln-Type"
HDR_CLAIM = "Kiln-Claim"
HDR_DLQ_REASON = "Kiln-Dlq-Reason"
HDR_DLQ_SUBJECT = "Kiln-Dlq-Subject"
HDR_DLQ_SERVICE = "Kiln-Dlq-Service"
HDR_ERROR = "Kiln-Error"

CLAIMS_BUCKET = "kiln-claims"
"""Object store bucket for claim-checked message bodies."""
SNAPSHOTS_BUCKET = "kiln-snapshots"
"""Object store bucket for workspace snapshots (``SandboxSnapshot``), readable by every node."""

# ---------------------------------------------------------------------------
# Streams and consumers
# ---------------------------------------------------------------------------


class Retention(str, Enum):
    LIMITS = "limits"
    WORK_QUEUE = "workqueue"


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    retention: Retention = Retention.LIMITS
    max_age_s: float = 7 * 24 * 3600
    duplicate_window_s: float = 600
    max_msgs_per_subject: int = -1
    description: str = ""


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer. ``ack_wait_s`` is how long a worker may hold a message
    without acking or heartbeating before JetStream redelivers it to another worker."""

    stream: str
    durable: str
    filter_subject: str
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    max_ack_pending: int = 1000
    description: str = ""
    overrides: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        "KILN_ROLLOUT_WORK",
        (ROLLOUT_WORK,),
        Retention.WORK_QUEUE,
        description="groups waiting for a rollout worker",
    ),
    StreamSpec(
        "KILN_ROLLOUT_RESUME",
        (ROLLOUT_RESUME,),
        Retention.WORK_QUEUE,
        description="suspended groups (partial samples) waiting to resume, ahead of fresh work",
    ),
    StreamSpec(
        "KILN_ROLLOUT_ABANDONED",
        (ROLLOUT_ABANDONED,),
        Retention.WORK_QUEUE,
        description="groups rollout gave up on, waiting for the controller to drop them",
    ),
    StreamSpec(
        "KILN_TRAJECTORIES",
        (TRAJECTORY_FINISHED,),
        Retention.WORK_QUEUE,
        description="finished trajectories waiting for reward",
    ),
    StreamSpec(
        "KILN_SCORED",
        (TRAJECTORY_SCORED,),
        Retention.WORK_QUEUE,
        description="scored trajectories waiting for the learner",
    ),
    StreamSpec(
        "KILN_EVAL",
        (EVAL_WORK,),
        Retention.WORK_QUEUE,
        description="evaluation episodes waiting for an eval worker",
    ),
    StreamSpec(
        "KILN_EVAL_SCORED",
        (EVAL_SCORED,),
        max_age_s=7 * 24 * 3600,
        description="scores of evaluation episodes (history, watched by collectors)",
    ),
    StreamSpec(
        "KILN_CHECKPOINTS",
        (WEIGHTS_CHECKPOINT,),
        Retention.WORK_QUEUE,
        description="learner checkpoints waiting for the weights service",
    ),
    StreamSpec(
        "KILN_WEIGHTS",
        (f"{WEIGHTS_PUBLISHED}.*",),
        max_msgs_per_subject=1000,
        description="published policy versions (history; rollout reads the latest)",
    ),
    StreamSpec(
        "KILN_EVENTS",
        (GROUP_DROPPED, STEP_METRICS, RUN_EVENTS, ROLLOUT_CONTROL),
        description="dropped-log, step metrics, run lifecycle and rollout control events",
    ),
    StreamSpec(
        "KILN_DLQ",
        (f"{DEAD_LETTER_PREFIX}.>",),
        max_age_s=30 * 24 * 3600,
        description="dead letters: raw bytes + reason of every rejected message",
    ),
)

ROLLOUT_WORKERS = ConsumerSpec(
    "KILN_ROLLOUT_WORK",
    "rollout-workers",
    ROLLOUT_WORK,
    ack_wait_s=60.0,
    max_deliver=4,
    max_ack_pending=256,
    description="shared by every rollout replica",
)
ROLLOUT_RESUMERS = ConsumerSpec(
    "KILN_ROLLOUT_RESUME",
    "rollout-resume",
    ROLLOUT_RESUME,
    ack_wait_s=60.0,
    max_deliver=4,
    max_ack_pending=256,
    description="suspended groups, shared by every rollout replica",
)
ABANDONED = ConsumerSpec(
    "KILN_ROLLOUT_ABANDONED",
    "controller-abandoned",
    ROLLOUT_ABANDONED,
    ack_wait_s=30.0,
    max_deliver=10,
    description="the controller drops each abandoned group once",
)
REWARD_WORKERS = ConsumerSpec(
    "KILN_TRAJECTORIES",
    "reward-workers",
    TRAJECTORY_FINISHED,
    ack_wait_s=60.0,
    max_deliver=5,
    description="shared by every reward replica",
)
LEARNER = ConsumerSpec(
    "KILN_SCORED",
    "learner",
    TRAJECTORY_SCORED,
    ack_wait_s=120.0,
    max_deliver=10,
    max_ack_pending=100_000,
    description="the learner holds messages unacked until the step that used them is published",
)
WEIGHTS_WRITERS = ConsumerSpec(
    "KILN_CHECKPOINTS",
    "weights-writers",
    WEIGHTS_CHECKPOINT,
    ack_wait_s=120.0,
    max_deliver=5,
    description="shared by every weights replica",
)

EVAL_WORKERS = ConsumerSpec(
    "KILN_EVAL",
    "eval-workers",
    EVAL_WORK,
    ack_wait_s=60.0,
    max_deliver=4,
    max_ack_pending=256,
    description="shared by every eval worker (rollout replicas with role = eval)",
)

CONSUMERS: tuple[ConsumerSpec, ...] = (
    ROLLOUT_WORKERS, ROLLOUT_RESUMERS, ABANDONED, REWARD_WORKERS, LEARNER, WEIGHTS_WRITERS, EVAL_WORKERS,
)  # fmt: skip


def stream_for_subject(subject: str) -> StreamSpec:
    """The stream that captures ``subject`` (JetStream wildcard rules)."""
    for spec in STREAMS:
        for pattern in spec.subjects:
            if subject_matches(pattern, subject):
                return spec
    raise KeyError(f"no stream captures subject {subject!r}")


def subject_matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


# ---------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------


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


class RolloutRequest(Message):
    """One group of ``n_samples`` rollouts of one task, all started from the same policy version."""

    run_id: str
    group_id: str
    task_id: str
    n_samples: int = Field(ge=1)
    dispatch_version: int = Field(ge=0)
    """Policy version the controller dispatched this group for; workers serve at least it."""
    deadline: float
    """Unix time after which the controller drops the group (reason ``deadline``)."""
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
    """Added or modified files that are not text or are too large (not carried)."""


class TrajectoryStatus(str, Enum):
    FINISHED = "finished"
    INFRA_ERROR = "infra_error"


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
    messages: list[ChatMessage] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    token_versions: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    num_turns: int = 0
    malformed_tool_calls: int = 0
    finish_reason: str = ""
    """Why the episode ended: ``no_tool_call``, ``max_turns``, ``max_tokens``, ``deadline``, ``error``."""
    sandbox: SandboxRef | None = None
    """The sandbox holding the final workspace; reward runs the tests there and destroys it."""
    final_diff: WorkspaceDiff | None = None
    """The final workspace as changes to the task's files, for scoring in a fresh sandbox
    when ``sandbox`` is gone."""
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
        return self

    def generated_versions(self) -> list[int]:
        return [v for v, m in zip(self.token_versions, self.loss_mask) if m]


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


class ScoredTrajectory(Message):
    trajectory: Trajectory
    reward: float
    passed: bool
    """All FAIL_TO_PASS and PASS_TO_PASS tests passed."""
    tests: dict[str, CaseStatus] = Field(default_factory=dict)
    reward_terms: dict[str, float] = Field(default_factory=dict)
    """Each term of ``reward`` (``tests`` and any shaping terms); ``reward`` is their sum."""
    rescored_from_diff: bool = False
    """The trajectory's sandbox was gone: the tests ran in a fresh one with its diff applied."""
    infra_error: str | None = None
    """Set when scoring could not run: the learner masks the trajectory out, never scores it 0."""
    test_output: str = ""
    scored_at: float = Field(default_factory=time.time)


class TensorInfo(Message):
    file: str
    dtype: str
    shape: list[int]


class FileInfo(Message):
    path: str
    size: int
    sha256: str


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
    reason: Literal["stale", "infra_error", "deadline", "invalid", "run_finished"]
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
    n_samples: int = Field(ge=1)
    temperature: float = Field(ge=0.0)
    seed: int
    deadline: float


class RunEvent(Message):
    run_id: str
    kind: Literal["started", "resumed", "finished", "failed"]
    detail: str = ""
    at: float = Field(default_factory=time.time)


# --- env-pool request/reply -------------------------------------------------


class SandboxCreate(Message):
    task_id: str
    run_id: str = ""
    ttl_s: float = 900.0
    """Lease length; the node reaps the sandbox after it unless renewed."""
    snapshot_key: str | None = None
    """Start from this snapshot (``SnapshotRef.key``) instead of the task's files."""


class SandboxCreated(Message):
    sandbox: SandboxRef
    workspace: str
    """Path of the workspace on the node (for operators; callers use the API, not the path)."""


class SandboxExec(Message):
    sandbox_id: str
    command: str
    timeout_s: float = 60.0


class ExecResult(Message):
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    truncated: bool = False


class SandboxTools(Message):
    sandbox_id: str
    calls: list[ToolCall]


class ToolResults(Message):
    results: list[ToolResult]


class SandboxFork(Message):
    """Clone a live sandbox's workspace into a new sandbox on the same node."""

    sandbox_id: str
    ttl_s: float = 900.0


class SandboxSnapshot(Message):
    sandbox_id: str


class SnapshotRef(Message):
    """A workspace captured in the ``kiln-snapshots`` object store, restorable on any node."""

    key: str
    size: int
    sha256: str
    task_id: str


class SandboxRenew(Message):
    sandbox_id: str
    ttl_s: float


class SandboxRenewed(Message):
    sandbox_id: str
    expires_at: float


class NodeStatsRequest(Message):
    """Body of a ``stats`` request (empty)."""


class NodeStats(Message):
    node_id: str
    backend: str
    cgroups: str
    """``v1``, ``v2`` or ``none`` (rlimits only)."""
    leased: int
    idle: int
    creating: int
    capacity: int
    created_total: int
    reaped_total: int
    http_url: str = ""


class SandboxDestroy(Message):
    sandbox_id: str


class SandboxDestroyed(Message):
    sandbox_id: str
    existed: bool


class HealthProbe(Message):
    """Body of a ``kiln.health.<service>`` request (empty)."""


class HealthReply(Message):
    service: str
    instance: str
    uptime_s: float
    detail: dict[str, Any] = Field(default_factory=dict)


SUBJECT_MESSAGES: dict[str, type[Message]] = {
    ROLLOUT_WORK: RolloutRequest,
    ROLLOUT_RESUME: RolloutRequest,
    ROLLOUT_CONTROL: RolloutControl,
    ROLLOUT_ABANDONED: GroupAbandoned,
    TRAJECTORY_FINISHED: Trajectory,
    TRAJECTORY_SCORED: ScoredTrajectory,
    WEIGHTS_CHECKPOINT: PolicyCheckpoint,
    f"{WEIGHTS_PUBLISHED}.*": WeightsPublished,
    GROUP_DROPPED: GroupDropped,
    STEP_METRICS: StepMetrics,
    RUN_EVENTS: RunEvent,
    EVAL_WORK: EvalRequest,
    EVAL_SCORED: ScoredTrajectory,
    ENVPOOL_CREATE: SandboxCreate,
}
"""The message type carried on each fixed subject (documentation and DLQ tooling)."""

ENVPOOL_NODE_MESSAGES: dict[str, tuple[type[Message], type[Message]]] = {
    "exec": (SandboxExec, ExecResult),
    "tools": (SandboxTools, ToolResults),
    "fork": (SandboxFork, SandboxCreated),
    "snapshot": (SandboxSnapshot, SnapshotRef),
    "renew": (SandboxRenew, SandboxRenewed),
    "diff": (SandboxDiff, WorkspaceDiff),
    "destroy": (SandboxDestroy, SandboxDestroyed),
    "stats": (NodeStatsRequest, NodeStats),
}

RolloutRequest.model_rebuild()
