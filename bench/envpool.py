"""env-pool latency and capacity, side by side in one run on this machine.

    .venv/bin/python bench/envpool.py [--n 300] [--concurrency 8] [--idle 1000] [--nodes 1] [--stop-grace 30]

(a) bare ``subprocess`` run of ``true``; (b) bare ``bwrap ... true`` with the sandbox's own
arguments; (c) env-pool create -> one ``run_terminal_cmd`` -> destroy over NATS (the full
lifecycle a rollout sample costs), sequentially for latency and ``--concurrency`` at a
time for lifecycles per second; (d) one ``read_file`` round trip on a live sandbox; then
``--idle`` sandboxes leased and held at once, with the node's memory (RSS of env-pool
and nats-server, plus the cgroups' and tmpfs's use) measured while they are held.
Everything runs against a real nats-server and a real env-pool node (its own process).
Prints a markdown table, whatever happens: a failed step prints the rows measured before
it and the error (then exits non-zero), and a node that does not stop within
``--stop-grace`` seconds of SIGTERM is SIGKILLed and named under the table (exit status 2:
the figures stand, the node's shutdown is a defect).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import STOP_GRACE_S, stop_children
from nats import errors as nats_errors

from kiln.envpool.config import EnvPoolConfig
from kiln.envpool.isolation.sandbox import Identity, Limits
from kiln.ops.embedded import NatsServer
from kiln.shared import contracts as c
from kiln.shared.bus import Bus, RemoteError
from kiln.shared.config import NatsSettings, load_config, render_toml
from kiln.shared.envpool_client import EnvPoolClient


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def row(name: str, samples: list[float], per_s: float | None = None) -> str:
    p50, p99 = pct(samples, 0.5) * 1e3, pct(samples, 0.99) * 1e3
    rate = f"{per_s:,.0f}" if per_s is not None else f"{1 / statistics.mean(samples):,.0f}"
    return f"| {name} | {p50:.2f} | {p99:.2f} | {rate} |"


def cpu_s(pid: int) -> tuple[float, float, float]:
    """(user CPU seconds, system CPU seconds, reaped children's CPU seconds) of a process."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(f[11]) / tick, int(f[12]) / tick, (int(f[13]) + int(f[14])) / tick


class _Pid:
    def __init__(self, pid: int):
        self.pid = pid


def _is_zygote(p: Path) -> bool:
    try:
        return b"zygote.py" in (p / "cmdline").read_bytes()
    except OSError:
        return False


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def main(n: int, concurrency: int, idle: int, nodes: int, stop_grace: float) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-envpool-"))
    nats = NatsServer(tmp / "nats").start()
    exp = tmp / "exp.toml"
    exp.write_text(
        render_toml(
            {
                "nats": {"url": nats.url},
                "telemetry": {"log_format": "text", "log_level": "WARNING"},
                "envpool": {
                    "node_id": "bench",
                    "max_sandboxes": idle + 64,
                    "warm_per_task": 4,
                    "semantic_mode": "bm25",
                    "reap_interval_s": 0.2,
                    "http": {"port": -1},
                },
            }
        )
    )
    cfg = load_config(EnvPoolConfig, exp)
    # Nodes run as their own processes, as deployed; this process is only their client.
    # Node "bench" serves every per-node measurement; extra nodes share creates (queue group).
    node = subprocess.Popen(
        [
            sys.executable,
            *os.environ.get("KILN_BENCH_NODE_PREFIX", "").split(),
            "-m",
            "kiln.envpool.main",
            "--config",
            str(exp),
            "--instance",
            "bench",
        ]
    )
    extra = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kiln.envpool.main",
                "--config",
                str(exp),
                "--instance",
                f"bench{i}",
                "--set",
                f'envpool.node_id="bench{i}"',
            ],
        )
        for i in range(1, nodes)
    ]
    children = {"env-pool node bench": node, **{f"env-pool node bench{i}": p for i, p in enumerate(extra, 1)}}
    rows: list[str] = []
    notes: list[str] = []  # the lines under the table, as they are measured
    error: BaseException | None = None
    bus = None
    try:  # from here on the nodes are stopped and the table printed whatever happens
        bus = await Bus.connect(NatsSettings(url=nats.url), "bench")
        pool = EnvPoolClient(bus)
        for name in ["bench"] + [f"bench{i}" for i in range(1, nodes)]:
            for attempt in range(300):
                try:
                    await pool.stats(name)
                    break
                except (TimeoutError, RemoteError, nats_errors.TimeoutError, nats_errors.NoRespondersError):
                    if attempt == 299:
                        raise
                    await asyncio.sleep(0.1)
        # (a) bare subprocess
        a = []
        for _ in range(n):
            t = time.perf_counter()
            subprocess.run(["true"], check=True)
            a.append(time.perf_counter() - t)
        rows.append(row("(a) bare subprocess `true`", a))

        # (b) bare bwrap with the sandbox's own arguments
        # Each node process works in its own folder (``<node id>-<pid>``): ask each where.
        roots = [
            Path((await pool.stats(name)).workspace_root) for name in ["bench"] + [f"bench{i}" for i in range(1, nodes)]
        ]
        ref = await pool.create("fix-calc")
        reply = await bus.request(c.ENVPOOL_CREATE, c.SandboxCreate(task_id="fix-calc"), c.SandboxCreated)
        from kiln.envpool.isolation import bwrap as bw

        etc = next(r for r in roots if Path(reply.workspace).is_relative_to(r)) / "etc"
        system = bw.system_args(cfg.envpool.ro_binds, etc)
        ws = Path(reply.workspace)
        sb = bw.BwrapSandbox("b", ws, Limits.from_settings(cfg.envpool), Identity(), None, None, system=system)
        argv = sb.argv(["true"])  # bwrap with the sandbox's own arguments, nothing around it

        def node_files() -> None:  # what the spawner's zygote does: the node's files at fds 3, 4, ...
            for fd, path in enumerate(system.files, 3):
                os.dup2(os.open(path, os.O_RDONLY), fd)

        zygotes = [_Pid(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_zygote(p)]
        call = c.ToolCall(id="t", name="run_terminal_cmd", arguments={"command": "true"})

        async def lifecycle() -> float:
            t = time.perf_counter()
            r = await pool.create("fix-calc")
            (res,) = await pool.tools(r, [call])
            assert res.error is None and res.output.startswith("exit code: 0"), res
            await pool.destroy(r)
            return time.perf_counter() - t

        for _ in range(20):  # warm up: templates, warm pool, caches
            await lifecycle()
        # (b) then (c), each in a tight loop, right after one another. (Interleaving them
        # one sample each was tried: every lifecycle then starts with four idle processes
        # to wake on this 2-vCPU VM, and (c) measured ~40% slower.)
        b = []
        for _ in range(n):
            t = time.perf_counter()
            subprocess.run(argv, check=True, preexec_fn=node_files, pass_fds=range(3, 3 + len(system.files)))
            b.append(time.perf_counter() - t)
        cseq = [await lifecycle() for _ in range(n)]
        rows.append(row("(b) bare `bwrap ... true`", b))
        await pool.destroy(reply.sandbox)
        procs = {"env-pool": [node, *extra], "zygote": zygotes, "nats-server": [nats.proc]}
        before = {k: [cpu_s(p.pid) for p in ps] for k, ps in procs.items()}
        me0 = os.times()
        for _ in range(n):
            await lifecycle()
        me1 = os.times()
        after = {k: [cpu_s(p.pid) for p in ps] for k, ps in procs.items()}
        rows.append(row("(c) create -> run_terminal_cmd -> destroy, sequential", cseq))
        notes.append(f"(c) p50 / (b) p50 = {pct(cseq, 0.5) / pct(b, 0.5):.2f}")

        def per(k: str, i: int) -> float:
            return 1e3 * sum(a[i] - b[i] for a, b in zip(after[k], before[k])) / n

        cpu_note = (
            f"CPU per sequential lifecycle: env-pool {per('env-pool', 0):.1f} ms user + {per('env-pool', 1):.1f} ms system, "
            f"its spawner {per('zygote', 0) + per('zygote', 1):.1f} ms, the sandboxes (bwrap, the command) "
            f"{per('zygote', 2):.1f} ms, nats-server "
            f"{per('nats-server', 0) + per('nats-server', 1):.1f} ms, this client "
            f"{1e3 * ((me1.user - me0.user) + (me1.system - me0.system)) / n:.1f} ms"
        )
        notes.append(cpu_note)
        done = 0
        t0 = time.perf_counter()
        cpar: list[float] = []

        async def worker() -> None:
            nonlocal done
            while done < n:
                done += 1
                cpar.append(await lifecycle())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rows.append(row(f"(c) same, {concurrency} at a time, {nodes} node(s)", cpar, n / (time.perf_counter() - t0)))

        read = c.ToolCall(id="r", name="read_file", arguments={"path": "calc.py"})
        d = []
        for _ in range(n):
            t = time.perf_counter()
            (res,) = await pool.tools(ref, [read])
            d.append(time.perf_counter() - t)
            assert res.error is None
        rows.append(row("(d) read_file round trip", d))

        # capacity: idle leased sandboxes held at once
        before = rss_mib(node.pid)
        t = time.perf_counter()
        held = []
        for i in range(0, idle, 32):
            held += await asyncio.gather(*(pool.create("fix-calc") for _ in range(min(32, idle - i))))
        took = time.perf_counter() - t
        du = subprocess.run(["du", "-smc", *map(str, roots)], capture_output=True, text=True, check=True)
        shm = du.stdout.splitlines()[-1].split()[0]  # the total line: every node's workspaces
        mem = (
            f"{len(held)} idle leased sandboxes created in {took:.1f} s; env-pool RSS {rss_mib(node.pid):.0f} MiB "
            f"(+{rss_mib(node.pid) - before:.0f} MiB for them), nats-server RSS {rss_mib(nats.proc.pid):.0f} MiB, "
            f"workspaces {shm} MiB of {'tmpfs' if all(str(r).startswith('/dev/shm/') for r in roots) else 'disk'}"
        )
        notes.append(mem)
        await asyncio.gather(*(pool.destroy(r) for r in held))
    except BaseException as e:
        error = e
        raise
    finally:
        stopping = stop_children(children, stop_grace)  # never raises: the table is printed next
        print_report(rows, notes, stopping, error)
        try:
            if bus is not None:
                await bus.close()
        finally:
            nats.stop()
    return 2 if stopping else 0


def print_report(rows: list[str], notes: list[str], stopping: list[str], error: BaseException | None) -> None:
    print("| operation | p50 ms | p99 ms | per second |\n|---|---|---|---|")
    print("\n".join(rows))
    for line in notes:
        print(f"\n{line}")
    if error is not None:
        print(f"\nINCOMPLETE: stopped by {type(error).__name__}: {error} (the rows above were measured before it)")
    for line in stopping:
        print(f"\nstopping: {line}")
    sys.stdout.flush()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=1, help="env-pool processes sharing the creates")
    ap.add_argument(
        "--stop-grace", type=float, default=STOP_GRACE_S, help="seconds the nodes get to exit after SIGTERM"
    )
    a = ap.parse_args()
    sys.exit(asyncio.run(main(a.n, a.concurrency, a.idle, a.nodes, a.stop_grace)))
