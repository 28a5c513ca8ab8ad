"""What several benchmarks share: a nats-server and an env-pool node (its own process,
bwrap sandboxes) serving a suite, and a bus client, until the block ends; and the way a
bench stops its children, so that one stuck child never costs the bench its results.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kiln.ops.embedded import NatsServer
from kiln.shared.bus import Bus
from kiln.shared.config import NatsSettings, render_toml
from kiln.shared.envpool_client import EnvPoolClient

STOP_GRACE_S = 30.0
"""How long children get, all together, to exit after SIGTERM before they are SIGKILLed."""


def stop_children(children: dict[str, subprocess.Popen], grace_s: float = STOP_GRACE_S) -> list[str]:
    """SIGTERM every child still running, wait up to ``grace_s`` in all, SIGKILL the rest.
    Returns one line per child that did not stop cleanly (killed, or an exit other than 0
    or SIGTERM's own), naming it, for the bench to print beside its table; never raises
    for a child."""
    for p in children.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    notes = []
    for name, p in children.items():
        try:
            code = p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            notes.append(f"{name} (pid {p.pid}) was still running {grace_s:.0f} s after SIGTERM: killed with SIGKILL")
            continue
        if code not in (0, -signal.SIGTERM):
            notes.append(f"{name} (pid {p.pid}) exited with code {code} after SIGTERM")
    return notes


@contextlib.asynccontextmanager
async def envpool_node(suite: str, probe_task: str, name: str, **envpool):
    """(bus, env-pool client) once the node creates sandboxes of ``probe_task``."""
    tmp = Path(tempfile.mkdtemp(prefix=f"kiln-bench-{name}-"))
    nats = NatsServer(tmp / "nats").start()
    exp = tmp / "exp.toml"
    exp.write_text(
        render_toml(
            {
                "run": {"id": "bench", "dir": str(tmp / "run")},
                "nats": {"url": nats.url},
                "tasks": {"suite": suite},
                "envpool": {"backend": "bwrap", **envpool},
            }
        )
    )
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
        for note in stop_children({f"env-pool node {name}": node}):
            print(note, file=sys.stderr, flush=True)
        nats.stop()
