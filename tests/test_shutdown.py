"""Services stop on the first SIGTERM, however loaded they are.

asyncio's ``loop.add_signal_handler`` learns which signal arrived from a byte in the
loop's self-pipe, the pipe every ``call_soon_threadsafe`` (each ``asyncio.to_thread``
completion) also writes a byte to: when a busy loop lets 278 of those pile up, the
signal's byte is dropped and its handler never runs. An env-pool node once lived on 17
minutes after such a SIGTERM. ``run_service`` installs ``StopSignals`` instead; the first
test fills the self-pipe for certain and signals a real service process (it fails with
``add_signal_handler``), the second stops a real env-pool node at full concurrency and
checks that it leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from harness import experiment, wait_for

from kiln.shared.bus import RemoteError
from kiln.shared.config import render_toml
from kiln.shared.envpool_client import EnvPoolClient

EXIT_BOUND_S = 120.0
"""Generous: a clean stop takes a few seconds here; a lost signal never ends."""


def alive(pid: int) -> bool:
    """A process that exists and has not exited (a zombie awaiting its reaper has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def processes_mentioning(*needles: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains one of ``needles``."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in cmdline for n in needles) and alive(int(p.name)):
            found.append((int(p.name), cmdline))
    return found


def children_of(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def test_sigterm_is_not_lost_when_the_self_pipe_is_full(nats_server, tmp_path):
    """A real service process (``run_service`` over nats-server) whose body does what a
    busy node does: its loop is busy while threads queue 5,000 wake-ups (far past the
    self-pipe's room), and the SIGTERM comes right then."""
    exp = tmp_path / "exp.toml"
    exp.write_text(render_toml({"nats": {"url": nats_server.url}, "telemetry": {"log_format": "text"}}))
    script = tmp_path / "busy_service.py"
    script.write_text(
        textwrap.dedent(f"""
        import asyncio, os, signal, sys, threading
        from kiln.shared.config import ServiceConfig, load_config
        from kiln.shared.service import run_service

        async def body(ctx):
            loop = asyncio.get_running_loop()
            def completions():  # what 5,000 asyncio.to_thread completions do to the loop
                for _ in range(5000):
                    loop.call_soon_threadsafe(lambda: None)
            t = threading.Thread(target=completions)
            t.start()
            t.join()  # the loop is blocked meanwhile: nothing drains its self-pipe
            os.kill(os.getpid(), signal.SIGTERM)
            try:
                await asyncio.wait_for(ctx.stop.wait(), 60)
            except asyncio.TimeoutError:
                print("SIGTERM lost", flush=True)
                sys.exit(3)
            print("stopped by SIGTERM", flush=True)

        asyncio.run(run_service("busy", load_config(ServiceConfig, {str(exp)!r}), body))
    """)
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=EXIT_BOUND_S)
    assert proc.returncode == 0 and "stopped by SIGTERM" in proc.stdout, (
        proc.returncode,
        proc.stdout,
        proc.stderr[-3000:],
    )
    assert "wakeup fd" not in proc.stderr, proc.stderr[-3000:]


async def test_env_pool_node_stops_on_first_sigterm_at_full_concurrency(nats_server, bus, run_dir):
    """A real env-pool process (bubblewrap sandboxes): every one of its 12 sandboxes runs
    a long command and 4 more slots churn create -> command -> destroy (thread-pool work
    on every create and destroy) when one SIGTERM comes. It exits 0, answers the calls in
    flight instead of leaving them hanging, and leaves no sandbox process or workspace."""
    held, churners = 12, 4
    node = "sigterm-node"
    marker = f"kiln-sigterm-{uuid.uuid4().hex[:8]}"
    exp = experiment(
        run_dir,
        nats_server.url,
        "sqlite://",
        envpool={"node_id": node, "max_sandboxes": held + churners, "warm_per_task": 0, "reap_interval_s": 0.2},
    )
    log_file = run_dir / "node.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.envpool.main", "--config", str(exp), "--instance", node],
        stdout=open(log_file, "wb"),
        stderr=subprocess.STDOUT,
    )
    pool = EnvPoolClient(bus, probe_s=0.5)
    churn_stop = asyncio.Event()
    churned = 0

    async def churn() -> None:
        nonlocal churned
        while not churn_stop.is_set():
            try:
                ref = await pool.create("fix-calc")
                await pool.exec(ref, "echo churn > churn.txt", 10)
                await pool.destroy(ref)
                churned += 1
            except (TimeoutError, RemoteError):
                if proc.poll() is not None or churn_stop.is_set():
                    return
                # pool_exhausted while a held sandbox takes a slot: go again

    try:

        async def up() -> bool:
            try:
                return (await pool.stats(node)).node_id == node
            except (TimeoutError, RemoteError):
                return False

        await wait_for(up, 60, 0.2, "the env-pool process")
        root = Path((await pool.stats(node)).workspace_root)
        refs = [await pool.create("fix-calc") for _ in range(held)]
        code = "import time; open('started', 'w').close(); time.sleep(300)"
        calls = [asyncio.create_task(pool.exec(r, f'python3 -c "{code}" {marker}', 300)) for r in refs]
        workers = [asyncio.create_task(churn()) for _ in range(churners)]
        # Busy: every held sandbox's command running (a count, as the node reports it and
        # as the sandboxes show it), and the churn well under way.
        await wait_for(
            lambda: sum(1 for _ in root.rglob("started")) >= held or any(c.done() for c in calls),
            60,
            0.1,
            "every held sandbox's command to start",
        )
        assert not any(c.done() for c in calls), [c.result() for c in calls if c.done()]
        assert len(processes_mentioning(marker)) >= held
        await wait_for(lambda: churned >= 5, 60, 0.1, "churn under way")
        stats = await pool.stats(node)
        assert stats.leased >= held and stats.capacity == held + churners, stats
        zygotes = [p for p in children_of(proc.pid) if b"zygote.py" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert zygotes

        proc.send_signal(signal.SIGTERM)  # once
        code_ = await asyncio.to_thread(proc.wait, EXIT_BOUND_S)  # raises if it outlives the bound
        churn_stop.set()
        assert code_ == 0, log_file.read_text()[-4000:]
        log = log_file.read_text()
        assert "wakeup fd" not in log and "SIGTERM, stopping" in log, log[-4000:]
        # The calls in flight end (the killed command's result, or the node's absence): none hangs.
        done, pending = await asyncio.wait(calls, timeout=60)
        assert not pending, f"{len(pending)} exec calls still waiting on a node that has exited"
        for c in done:
            if c.exception() is None:
                assert c.result().exit_code != 0 or c.result().timed_out, c.result()
            else:
                assert isinstance(c.exception(), RemoteError), c.exception()
        for w in workers:  # load, not under test: one may wait out a request the exiting node took
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        # Nothing left behind: no sandboxed command, no bwrap, no launcher, no workspace.
        await wait_for(
            lambda: not processes_mentioning(marker, str(root)) and not any(map(alive, zygotes)),
            30,
            0.1,
            "the node's sandbox processes to be gone",
        )
        assert not root.exists(), sorted(map(str, root.rglob("*")))[:20]
    finally:
        churn_stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid, _ in processes_mentioning(marker):
            os.kill(pid, signal.SIGKILL)
