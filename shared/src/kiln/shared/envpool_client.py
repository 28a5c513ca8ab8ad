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

    async def create(self, task_id: str, *, run_id: str = "", ttl_s: float = 900.0) -> c.SandboxRef:
        r = await self.bus.request(
            c.ENVPOOL_CREATE, c.SandboxCreate(task_id=task_id, run_id=run_id, ttl_s=ttl_s), c.SandboxCreated,
            timeout=self.timeout_s,
        )
        return r.sandbox

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
        r = await self.bus.request(
            c.envpool_node_subject(ref.node_id, "destroy"),
            c.SandboxDestroy(sandbox_id=ref.sandbox_id),
            c.SandboxDestroyed,
            timeout=self.timeout_s,
        )
        return r.existed
