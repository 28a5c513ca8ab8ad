"""What several benchmarks start: a nats-server and an env-pool node (its own process,
bwrap sandboxes) serving a suite, and a bus client, until the block ends."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kiln.shared.bus import Bus
from kiln.shared.config import NatsSettings, render_toml
from kiln.shared.embedded import NatsServer
from kiln.shared.envpool_client import EnvPoolClient


@contextlib.asynccontextmanager
async def envpool_node(suite: str, probe_task: str, name: str, **envpool):
    """(bus, env-pool client) once the node creates sandboxes of ``probe_task``."""
    tmp = Path(tempfile.mkdtemp(prefix=f"kiln-bench-{name}-"))
    nats = NatsServer(tmp / "nats").start()
    exp = tmp / "exp.toml"
    exp.write_text(render_toml({"run": {"id": "bench", "dir": str(tmp / "run")}, "nats": {"url": nats.url},
                                "tasks": {"suite": suite}, "envpool": {"backend": "bwrap", **envpool}}))  # fmt: skip
    node = subprocess.Popen([sys.executable, "-m", "kiln.envpool.main", "--config", str(exp), "--instance", name])
    bus = None
    try:
        bus = await Bus.connect(NatsSettings(url=nats.url), f"bench-{name}")
        pool = EnvPoolClient(bus)
        for _ in range(600):  # the node loads its search model first
            try:
                await pool.destroy(await pool.create(probe_task))
                break
            except Exception:
                await asyncio.sleep(0.1)
        yield bus, pool
    finally:
        if bus is not None:
            await bus.close()
        node.send_signal(signal.SIGTERM)
        node.wait(30)
        nats.stop()
