"""Request/reply schemas of env-pool nodes and the health probe.

Part of ``kiln.shared.contracts`` (import them from there).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from kiln.shared.contracts.messages import Message, SandboxRef, ToolCall, ToolResult

ENVIRONMENT_ERROR = "environment_error"
"""Error code of a create whose task's environment cannot be built (the reason names the
environment and the step); the controller sets that environment's tasks aside."""


Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A duration a client asks for: finite and not negative. JSON parsers accept ``NaN``
and ``Infinity``; a NaN lease is never reaped and an infinite one's expiry cannot be
sent back (JSON has no infinity): both are refused as malformed."""


class SandboxCreate(Message):
    task_id: str
    run_id: str = ""
    ttl_s: Seconds = 900.0
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
    timeout_s: Seconds = 60.0


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
    timeout_s: Seconds | None = None
    """The whole batch's time: each command's own timeout is cut to what is left of it,
    and a call it leaves no time for is answered with an error, so the node always answers
    within it (a slow command is the caller's observation, never a lost request). None:
    each command's own timeout only."""


class ToolResults(Message):
    results: list[ToolResult]


class SandboxFork(Message):
    """Clone a live sandbox's workspace into a new sandbox on the same node."""

    sandbox_id: str
    ttl_s: Seconds = 900.0


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
    ttl_s: Seconds


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
    boot: str = ""
    """This node process's random id (each start has its own; ``SandboxRef.boot``)."""
    workspace_root: str = ""
    """This node process's own folder (``<base>/<node id>-<pid>``): templates, ``ws/``
    with every workspace, and the files bwrap binds into sandboxes."""


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
