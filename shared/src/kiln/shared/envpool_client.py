"""Client of the env-pool API for rollout and reward (request/reply over NATS).

``create`` goes to the ``envpool`` queue group; every later call goes to the node that
owns the sandbox (``SandboxRef.node_id``). Failures raise ``RemoteError`` with the
service's code (``pool_exhausted``, ``not_found``, ``unknown_task``, ``timeout``,
``no_responders``): callers treat them as infrastructure errors, not as the agent's.
"""

from __future__ import annotations

from kiln.shared import contracts as c
from kiln.shared.bus import Bus


class EnvPoolClient:
    def __init__(self, bus: Bus, timeout_s: float | None = None):
        self.bus = bus
        self.timeout_s = timeout_s

    async def create(
        self, task_id: str, *, run_id: str = "", ttl_s: float = 900.0, snapshot_key: str | None = None
    ) -> c.SandboxRef:
        """A sandbox from the task's files, or from a snapshot taken on any node."""
        r = await self.bus.request(
            c.ENVPOOL_CREATE,
            c.SandboxCreate(task_id=task_id, run_id=run_id, ttl_s=ttl_s, snapshot_key=snapshot_key),
            c.SandboxCreated,
            timeout=self.timeout_s,
        )
        return r.sandbox

    async def fork(self, ref: c.SandboxRef, ttl_s: float = 900.0) -> c.SandboxRef:
        """A copy of a live sandbox's workspace (on the same node)."""
        r = await self._node(ref, "fork", c.SandboxFork(sandbox_id=ref.sandbox_id, ttl_s=ttl_s))
        return r.sandbox

    async def snapshot(self, ref: c.SandboxRef) -> c.SnapshotRef:
        return await self._node(ref, "snapshot", c.SandboxSnapshot(sandbox_id=ref.sandbox_id))

    async def renew(self, ref: c.SandboxRef, ttl_s: float) -> float:
        """Extend the lease; returns the new expiry (unix time)."""
        return (await self._node(ref, "renew", c.SandboxRenew(sandbox_id=ref.sandbox_id, ttl_s=ttl_s))).expires_at

    async def diff(self, ref: c.SandboxRef) -> c.WorkspaceDiff:
        """The workspace as changes to its task's files."""
        return await self._node(ref, "diff", c.SandboxDiff(sandbox_id=ref.sandbox_id))

    async def stats(self, node_id: str) -> c.NodeStats:
        return await self.bus.request(
            c.envpool_node_subject(node_id, "stats"), c.NodeStatsRequest(), c.NodeStats, timeout=self.timeout_s
        )

    async def _node(self, ref: c.SandboxRef, op: str, msg: c.Message):
        _, reply = c.ENVPOOL_NODE_MESSAGES[op]
        return await self.bus.request(c.envpool_node_subject(ref.node_id, op), msg, reply, timeout=self.timeout_s)

    async def exec(self, ref: c.SandboxRef, command: str, timeout_s: float) -> c.ExecResult:
        return await self.bus.request(
            c.envpool_node_subject(ref.node_id, "exec"),
            c.SandboxExec(sandbox_id=ref.sandbox_id, command=command, timeout_s=timeout_s),
            c.ExecResult,
            timeout=timeout_s + 10.0,
        )

    async def tools(self, ref: c.SandboxRef, calls: list[c.ToolCall], timeout_s: float = 120.0) -> list[c.ToolResult]:
        r = await self.bus.request(
            c.envpool_node_subject(ref.node_id, "tools"),
            c.SandboxTools(sandbox_id=ref.sandbox_id, calls=calls),
            c.ToolResults,
            timeout=timeout_s,
        )
        return r.results

    async def destroy(self, ref: c.SandboxRef) -> bool:
        return (await self._node(ref, "destroy", c.SandboxDestroy(sandbox_id=ref.sandbox_id))).existed
