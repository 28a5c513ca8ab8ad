"""The sandboxes one env-pool node owns, with leases.

Invariants: the node never holds more than ``max_sandboxes`` (counting ones being
created): beyond that ``create`` fails at once with ``pool_exhausted`` (backpressure,
never a wait); every sandbox has a lease and the reaper destroys it when the lease
expires, so a rollout or reward worker that dies leaks nothing for longer than its TTL.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kiln.shared.bus import ServiceError
from kiln.shared.tasks import TaskSuite

from kiln.envpool.config import EnvPoolSettings
from kiln.envpool.sandbox import ProcessSandbox, Sandbox

log = logging.getLogger("kiln.envpool.pool")


@dataclass
class Lease:
    sandbox: Sandbox
    task_id: str
    run_id: str
    expires_at: float
    created_at: float


class SandboxPool:
    def __init__(self, settings: EnvPoolSettings, suite: TaskSuite, root: Path):
        self.settings = settings
        self.suite = suite
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.leases: dict[str, Lease] = {}
        self.creating = 0
        self.created_total = 0
        self.reaped_total = 0

    def __len__(self) -> int:
        return len(self.leases)

    async def create(self, task_id: str, run_id: str, ttl_s: float) -> Sandbox:
        if len(self.leases) + self.creating >= self.settings.max_sandboxes:
            raise ServiceError(
                f"pool exhausted: this node holds {len(self.leases)} of {self.settings.max_sandboxes} sandboxes",
                "pool_exhausted",
            )
        try:
            task = self.suite.get(task_id)
        except KeyError as e:
            raise ServiceError(str(e.args[0]), "unknown_task") from None
        self.creating += 1
        try:
            sid = f"sb-{uuid.uuid4().hex[:12]}"
            ws = self.root / sid
            ws.mkdir()
            for rel, text in task.files.items():
                f = ws / rel
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(text)
            sb = ProcessSandbox(
                sid,
                ws,
                output_limit=self.settings.output_limit_bytes,
                cpu_seconds=self.settings.cpu_seconds,
                max_file_bytes=self.settings.max_file_bytes,
            )
            now = time.time()
            self.leases[sid] = Lease(sb, task_id, run_id, now + ttl_s, now)
            self.created_total += 1
            return sb
        finally:
            self.creating -= 1

    def get(self, sandbox_id: str) -> Sandbox:
        lease = self.leases.get(sandbox_id)
        if lease is None:
            raise ServiceError(f"sandbox {sandbox_id} does not exist on this node (destroyed or expired)", "not_found")
        return lease.sandbox

    def renew(self, sandbox_id: str, ttl_s: float) -> None:
        lease = self.leases.get(sandbox_id)
        if lease:
            lease.expires_at = max(lease.expires_at, time.time() + ttl_s)

    async def destroy(self, sandbox_id: str) -> bool:
        lease = self.leases.pop(sandbox_id, None)
        if lease is None:
            return False
        await lease.sandbox.destroy()
        return True

    async def reap(self) -> int:
        now = time.time()
        expired = [sid for sid, lease in self.leases.items() if lease.expires_at < now]
        for sid in expired:
            log.info("lease of %s expired; destroying it", sid)
            await self.destroy(sid)
        self.reaped_total += len(expired)
        return len(expired)

    async def close(self) -> None:
        for sid in list(self.leases):
            await self.destroy(sid)
        shutil.rmtree(self.root, ignore_errors=True)

    def stats(self) -> dict:
        return {
            "live": len(self.leases),
            "creating": self.creating,
            "capacity": self.settings.max_sandboxes,
            "created_total": self.created_total,
            "reaped_total": self.reaped_total,
        }
