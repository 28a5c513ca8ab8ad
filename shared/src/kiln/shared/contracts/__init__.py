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

Subjects, streams and consumers are declared in this file; the message schemas in
``messages`` (the run's) and ``envpool`` (env-pool's request/reply), all exported here:
``from kiln.shared import contracts as c; c.Trajectory``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

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
ENVIRONMENTS_BUCKET = "kiln-environments"
"""Object store bucket for built environment layers (a tar.gz per layer digest), so one
node's build serves every node (``kiln.envpool.environments.NatsLayerStore``)."""

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
    ROLLOUT_WORKERS,
    ROLLOUT_RESUMERS,
    ABANDONED,
    REWARD_WORKERS,
    LEARNER,
    WEIGHTS_WRITERS,
    EVAL_WORKERS,
)


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
# Messages (declared in the package's modules, exported here)
# ---------------------------------------------------------------------------

from kiln.shared.contracts.envpool import *  # noqa: E402, F403
from kiln.shared.contracts.messages import *  # noqa: E402, F403
from kiln.shared.contracts.messages import Message  # noqa: E402

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
