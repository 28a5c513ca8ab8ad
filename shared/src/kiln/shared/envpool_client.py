"""Client of the env-pool API for rollout and reward (request/reply over NATS).

``create`` goes to the ``envpool`` queue group; every later call goes to the node that
owns the sandbox (``SandboxRef.node_id``). Failures raise ``RemoteError`` with the
service's code (``pool_exhausted``, ``not_found``, ``unknown_task``, ``timeout``,
``no_responders``): callers treat them as infrastructure errors, not as the agent's. So nothing the agent
asks for may end in one: a batch of tools carries its time (``timeout_s``) and the node
answers within it, a slow command being an observation that says it was killed.

A long call (``exec``, ``tools``) to a node that dies does not wait out its timeout (a
test run's 40 s, a turn's tools): every ``probe_s`` while it waits, the client asks the
node for its ``stats``; no node serving (``node_gone``) or a node of another boot than
the one that made the sandbox (``node_restarted``: its sandboxes died with the old
process) ends the call at once. A node that is merely slow to answer the probe is left
to its call's own timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from kiln.shared import contracts as c
from kiln.shared.bus import Bus, RemoteError

T = TypeVar("T")

PROBE_S = 5.0
REPLY_MARGIN_S = 10.0
"""How much longer than the work it asks for (a command's or a batch's timeout) a call
waits for its answer: the node's own bookkeeping (kill, usage walk, reply) beyond it."""


class EnvPoolClient:
    def __init__(self, bus: Bus, timeout_s: float | None = None, probe_s: float = PROBE_S):
        self.bus = bus
        self.timeout_s = timeout_s
        self.probe_s = probe_s

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
        return await self._watched(
            ref,
            self.bus.request(
                c.envpool_node_subject(ref.node_id, "exec"),
                c.SandboxExec(sandbox_id=ref.sandbox_id, command=command, timeout_s=timeout_s),
                c.ExecResult,
                timeout=timeout_s + REPLY_MARGIN_S,
            ),
        )

    async def tools(self, ref: c.SandboxRef, calls: list[c.ToolCall], timeout_s: float = 120.0) -> list[c.ToolResult]:
        """Run a batch within ``timeout_s``: the node cuts each command to what is left of it
        and answers the calls it leaves no time for with errors (``SandboxTools.timeout_s``),
        so a slow command is an observation; the request itself waits ``REPLY_MARGIN_S``
        longer, for the node's answer to arrive."""
        r = await self._watched(
            ref,
            self.bus.request(
                c.envpool_node_subject(ref.node_id, "tools"),
                c.SandboxTools(sandbox_id=ref.sandbox_id, calls=calls, timeout_s=timeout_s),
                c.ToolResults,
                timeout=timeout_s + REPLY_MARGIN_S,
            ),
        )
        return r.results

    async def _watched(self, ref: c.SandboxRef, call: Awaitable[T]) -> T:
        """``call``, ended early with ``RemoteError`` when the sandbox's node dies meanwhile."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.probe_s)
                if done:
                    return task.result()
                await self._probe(ref)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _probe(self, ref: c.SandboxRef) -> None:
        stats = None
        for attempt in range(2):  # the second rules out a subscription being renewed after a reconnect
            try:
                stats = await self.bus.request(
                    c.envpool_node_subject(ref.node_id, "stats"),
                    c.NodeStatsRequest(),
                    c.NodeStats,
                    timeout=self.probe_s,
                )
                break
            except RemoteError as e:
                if e.code != "no_responders":
                    return  # slow or busy: the call's own timeout decides
                if attempt:
                    raise RemoteError(
                        "node_gone", f"env-pool node {ref.node_id} died with sandbox {ref.sandbox_id}"
                    ) from None
                await asyncio.sleep(1.0)
            except Exception:  # the bus itself is reconnecting: not evidence about the node
                return
        if stats is not None and ref.boot and stats.boot and stats.boot != ref.boot:
            raise RemoteError(
                "node_restarted", f"env-pool node {ref.node_id} restarted: sandbox {ref.sandbox_id} died with it"
            )

    async def destroy(self, ref: c.SandboxRef) -> bool:
        return (await self._node(ref, "destroy", c.SandboxDestroy(sandbox_id=ref.sandbox_id))).existed
