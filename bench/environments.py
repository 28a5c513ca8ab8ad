"""Environment sandboxes (docs/environments.md) against today's text workspaces, side by
side in one run through a real env-pool node (its own process, as root: overlayfs and
idmapped mounts) and a real nats-server, the way bench/envpool.py starts them.

    .venv/bin/python bench/environments.py [--n 300] [--idle 1000]
        [--sdist pandas==2.2.3] [--packages numpy pandas==2.2.3 scipy pytest] [--import numpy]
    .venv/bin/python bench/environments.py --small --n 3 --idle 3      # a tiny dir repo, iniconfig

One environment (a real package's sdist as the repository, a uv-built virtualenv with
heavy dependencies; ``--small``: a few files and ``iniconfig``), served with the built-in
suite's text task (``fix-calc``) by one node whose environments root starts empty:

- build: the first create of the environment task on the fresh root (the node builds the
  layers and stores them in the NATS layer store; the node's log gives the build alone),
  then a second ``kiln env build`` on the same root (a process of its own) and a second
  ``EnvironmentCache.get`` in this process; the layers' sizes (``du``);
- create -> one ``run_terminal_cmd`` -> destroy, sequentially, for the text task and the
  environment task (``true``; then a python command in each);
- fork of a sandbox with a few changed files (the child destroyed after each);
- the overlay view alone (mount + unmount in this process over the same layers): what a
  create adds to a text workspace's;
- ``--idle`` sandboxes of each task leased and held at once: the node folder's ``du -x``
  (upper directories, templates; not the mounted views), env-pool's RSS, the kernel's
  slab and shared memory (tmpfs) and the mount count while they are held.

Prints a markdown table and the notes under it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nats import errors as nats_errors

from kiln.ops.embedded import NatsServer
from kiln.shared import contracts as c
from kiln.shared.bus import Bus, RemoteError
from kiln.shared.config import NatsSettings, render_toml
from kiln.shared.environments import load_environments
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.tasks import Task, load_suite

ENV_TASK = "env-task"
TEXT_TASK = "fix-calc"
# a few changed files before a fork: two repository files edited, one deleted, three new
CHANGES = (
    "set -e; n=0; for f in $(find . -name '*.py' -type f | sort | head -50); do [ -w \"$f\" ] || continue; "
    'n=$((n+1)); if [ $n -le 2 ]; then echo \'# changed\' >> "$f"; elif [ $n -eq 3 ]; then rm "$f"; else break; fi; done; '
    "mkdir -p notes; echo a > notes/a.txt; echo b > notes/b.txt; echo c > new.txt"
)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def ms(xs: list[float]) -> tuple[str, str]:
    return f"{pct(xs, 0.5) * 1e3:.2f}", f"{pct(xs, 0.99) * 1e3:.2f}"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def meminfo() -> dict[str, float]:
    """/proc/meminfo in MiB."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0]) / 1024
    return out


def mounts() -> int:
    return len(Path("/proc/self/mountinfo").read_text().splitlines())


def du_mib(*paths: Path, one_fs: bool = False) -> float:
    out = subprocess.run(
        ["du", "-sc", "-B1", *(["-x"] if one_fs else []), *map(str, paths)], capture_output=True, text=True, check=True
    ).stdout
    return int(out.splitlines()[-1].split()[0]) / 2**20


def mib(v: float) -> str:
    return f"{v:,.1f}" if abs(v) < 10 else f"{v:,.0f}"


def inline(v) -> str:
    """A value as TOML (inline tables for dicts)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {inline(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(inline(x) for x in v) + "]"
    return json.dumps(v)


def write_suite(folder: Path, env: dict) -> tuple[Path, Path]:
    """A suite of the built-in text task and one task over ``env``; the environment also
    as an ``[[environments]]`` file for ``kiln env build``."""
    text = load_suite("builtin").get(TEXT_TASK)
    task = Task(
        id=ENV_TASK,
        problem_statement="benchmark",
        files={"KILN_TASK.md": "a task's own file\n"},
        test_command="true",
        fail_to_pass=["x"],
        environment=env["name"],
    )
    (folder / "tasks.jsonl").write_text(text.model_dump_json() + "\n" + task.model_dump_json() + "\n")
    (folder / "suite.toml").write_text(f'tasks = "tasks.jsonl"\nenvironments = [{inline(env)}]\n')
    (folder / "environments.toml").write_text(
        "[[environments]]\n" + "".join(f"{k} = {inline(v)}\n" for k, v in env.items())
    )
    return folder / "suite.toml", folder / "environments.toml"


def small_repository(folder: Path) -> Path:
    repo = folder / "repo"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "calc" / "more.py").write_text("X = 1\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_calc.py").write_text("from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    return repo


async def main(a) -> None:
    from kiln.envpool.environments import EnvironmentCache
    from kiln.envpool.workspaces import overlay

    if why := overlay.supported():
        sys.exit(f"environment sandboxes cannot run here: {why}")
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-environments-"))
    # on disk, not tmpfs, like envpool.environments_root; fresh: the first create builds
    env_root = Path(a.env_root) if a.env_root else Path(tempfile.mkdtemp(prefix="kiln-bench-envroot-", dir="/var/tmp"))
    if a.small:
        env = {
            "name": "bench-small",
            "repository": {"kind": "dir", "path": str(small_repository(tmp))},
            "python": {"interpreter": a.interpreter, "packages": a.packages or ["iniconfig"]},
        }
        module = a.import_ or "iniconfig"
    else:
        name, version = a.sdist.split("==")
        env = {
            "name": f"bench-{name}",
            "repository": {"kind": "sdist", "name": name, "version": version},
            "python": {
                "interpreter": a.interpreter,
                "packages": a.packages or ["numpy", "pandas==2.2.3", "scipy", "pytest"],
            },
        }
        module = a.import_ or "numpy"
    suite, env_file = write_suite(tmp, env)
    (spec,) = load_environments(env_file)
    nats = NatsServer(tmp / "nats").start()
    exp = tmp / "exp.toml"
    exp.write_text(
        render_toml(
            {
                "nats": {"url": nats.url},
                "telemetry": {"log_format": "text", "log_level": "INFO"},  # INFO: the cache logs the build time
                "tasks": {"suite": str(suite)},
                "envpool": {
                    "node_id": "bench",
                    "backend": "bwrap",
                    "max_sandboxes": 2 * a.idle + 64,
                    "warm_per_task": a.warm,
                    "semantic_mode": "bm25",
                    "reap_interval_s": 0.2,
                    "http": {"port": -1},
                    "environments": {"root": str(env_root)},
                },
            }
        )
    )
    log_path = tmp / "node.log"
    log = open(log_path, "w")
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
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    bus = await Bus.connect(NatsSettings(url=nats.url), "bench")
    pool = EnvPoolClient(bus)
    rows: list[str] = []
    notes: list[str] = []
    try:
        for attempt in range(300):
            try:
                stats = await pool.stats("bench")
                break
            except (TimeoutError, RemoteError, nats_errors.TimeoutError, nats_errors.NoRespondersError):
                if attempt == 299 or node.poll() is not None:
                    raise RuntimeError(f"the node did not start:\n{log_path.read_text()[-3000:]}") from None
                await asyncio.sleep(0.1)
        node_root = Path(stats.workspace_root)

        # -- build: cold through the node, then cached --------------------------------------
        t = time.perf_counter()
        made = await bus.request(
            c.ENVPOOL_CREATE, c.SandboxCreate(task_id=ENV_TASK), c.SandboxCreated, timeout=a.build_timeout
        )
        cold = time.perf_counter() - t
        first = made.sandbox
        built_s = re.findall(r"built in ([\d.]+)s", log_path.read_text())
        stored = len(re.findall(r"stored layer", log_path.read_text()))
        t = time.perf_counter()
        cli = subprocess.run(
            [str(Path(sys.executable).parent / "kiln"), "env", "build", str(env_file), "--root", str(env_root)],
            capture_output=True,
            text=True,
        )
        cli_s = time.perf_counter() - t
        assert cli.returncode == 0 and cli.stdout.rstrip().endswith("cached"), (cli.stdout, cli.stderr)
        cache = EnvironmentCache(env_root, 1 << 50)
        t = time.perf_counter()
        built = await cache.get(spec)
        get_s = time.perf_counter() - t
        assert cache.builds == 0
        sizes = {la.name: du_mib(la.path) for la in built.layers}
        total = du_mib(*(la.path for la in built.layers))
        layer_note = ", ".join(f"{k} {mib(v)} MiB" for k, v in sizes.items())
        notes.append(
            f"environment {spec.name} ({built.digest[:12]}): layers {layer_note}; {mib(total)} MiB in all (du); "
            f"uv cache {mib(du_mib(env_root / 'uv-cache'))} MiB (the venv's files are hard links into it)"
        )
        build_note = f"built in {built_s[0]} s" if built_s else "build time not logged"
        rows.append(
            f"| cold build: first create on a fresh environments root (node; {build_note}, "
            f"then {stored} layer(s) stored in NATS) | {cold:.1f} s | | |"
        )
        rows.append(
            f"| cached: `kiln env build` again on the same root (a new process: imports included) | {cli_s:.2f} s | | |"
        )
        rows.append(f"| cached: `EnvironmentCache.get` again (in process) | {get_s * 1e3:.1f} ms | | |")

        # -- lifecycles ------------------------------------------------------------------------
        async def lifecycle(task: str, command: str) -> float:
            call = c.ToolCall(id="t", name="run_terminal_cmd", arguments={"command": command})
            t = time.perf_counter()
            r = await pool.create(task)
            (res,) = await pool.tools(r, [call])
            assert res.error is None and res.output.startswith("exit code: 0"), res
            await pool.destroy(r)
            return time.perf_counter() - t

        text_py, env_py = "python3 -c pass", f"python -c 'import {module}'"
        for _ in range(max(3, min(20, a.n))):  # warm up: templates, warm pools, caches
            await lifecycle(TEXT_TASK, "true")
            await lifecycle(ENV_TASK, "true")
        life = {}
        for task, command in [(TEXT_TASK, "true"), (ENV_TASK, "true"), (TEXT_TASK, text_py), (ENV_TASK, env_py)]:
            life[task, command] = [await lifecycle(task, command) for _ in range(a.n)]
        text_true, env_true = life[TEXT_TASK, "true"], life[ENV_TASK, "true"]
        for (task, command), xs in life.items():
            kind = "environment" if task == ENV_TASK else "text"
            rows.append(f"| create -> `{command}` -> destroy, {kind} task `{task}` | {' | '.join(ms(xs))} | {a.n} |")
        ratio = pct(env_true, 0.5) / pct(text_true, 0.5)

        # -- fork --------------------------------------------------------------------------
        fork_p50 = {}
        for task in (ENV_TASK, TEXT_TASK):
            parent = first if task == ENV_TASK else await pool.create(task)
            r = await pool.exec(parent, CHANGES, 60)
            assert r.exit_code == 0, r
            changed = await pool.diff(parent)
            xs = []
            for _ in range(a.n):
                t = time.perf_counter()
                child = await pool.fork(parent)
                xs.append(time.perf_counter() - t)
                await pool.destroy(child)
            fork_p50[task] = pct(xs, 0.5)
            what = f"{len(changed.changed)} changed, {len(changed.deleted)} deleted file(s)"
            kind = "environment" if task == ENV_TASK else "text"
            rows.append(
                f"| fork of {'an' if kind[0] == 'e' else 'a'} {kind} sandbox ({what}) | {' | '.join(ms(xs))} | {a.n} |"
            )
            await pool.destroy(parent)

        # -- the overlay view alone, in this process --------------------------------------
        from kiln.envpool.workspaces.overlay import IdmapNamespaces, LowerLayer, OverlayView

        lowers = [LowerLayer(la.path, owned=la.name == "repository") for la in built.layers]
        task_layer = tmp / "task-layer"
        (task_layer / "workspace").mkdir(parents=True)
        lowers.append(LowerLayer(task_layer, owned=True))
        idmaps = IdmapNamespaces()
        views = tmp / "views"
        views.mkdir()
        first_ns = time.perf_counter()
        idmaps.fd(190_000, 190_000)
        first_ns = time.perf_counter() - first_ns
        xs, ys = [], []
        for i in range(a.n):
            v = OverlayView(views / str(i), tuple(lowers))
            (views / str(i)).mkdir()
            t = time.perf_counter()
            v.mount(190_000, 190_000, idmaps)
            xs.append(time.perf_counter() - t)
            t = time.perf_counter()
            v.unmount()
            ys.append(time.perf_counter() - t)
        idmaps.close()
        shutil.rmtree(views, ignore_errors=True)
        rows.append(
            f"| overlay view mount ({len(lowers)} layers, {sum(la.owned for la in lowers)} idmapped), in process | {' | '.join(ms(xs))} | {a.n} |"
        )
        rows.append(f"| overlay view unmount, in process | {' | '.join(ms(ys))} | {a.n} |")
        notes.append(f"the first idmapped mount of a uid also makes its user namespace: {first_ns * 1e3:.1f} ms once")

        # -- idle sandboxes held at once ----------------------------------------------------
        async def settle() -> None:  # destroys finish in the background: wait for their folders to go
            for _ in range(1200):
                s = await pool.stats("bench")
                if s.leased == 0 and s.creating == 0 and len(os.listdir(node_root / "ws")) <= s.idle:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)

        idle = {}
        for task in (TEXT_TASK, ENV_TASK):
            await settle()
            # -x: not through the overlay views; the workspaces' own tmpfs is named on its own
            m0, n0, r0, d0 = meminfo(), mounts(), rss_mib(node.pid), du_mib(node_root, node_root / "ws", one_fs=True)
            t = time.perf_counter()
            held = []
            for i in range(0, a.idle, 32):
                held += await asyncio.gather(*(pool.create(task) for _ in range(min(32, a.idle - i))))
            took = time.perf_counter() - t
            await asyncio.sleep(0.5)
            m1, n1, r1, d1 = meminfo(), mounts(), rss_mib(node.pid), du_mib(node_root, node_root / "ws", one_fs=True)
            idle[task] = (
                d1,
                r1,
                r1 - r0,
                m1["Slab"] - m0["Slab"],
                m1["Shmem"] - m0["Shmem"],
                n1 - n0,
                (m0["MemAvailable"] - m1["MemAvailable"]),
            )
            kind = "environment" if task == ENV_TASK else "text"
            notes.append(
                f"{len(held)} idle leased {kind} sandboxes (`{task}`) created in {took:.1f} s: node folder {mib(d1)} MiB "
                f"(du -x; {d1 - d0:+,.1f} MiB), env-pool RSS {r1:.0f} MiB ({r1 - r0:+.0f} MiB), kernel slab "
                f"{m1['Slab'] - m0['Slab']:+,.0f} MiB, shared memory (tmpfs) {m1['Shmem'] - m0['Shmem']:+,.0f} MiB, "
                f"MemAvailable {m1['MemAvailable'] - m0['MemAvailable']:+,.0f} MiB (the whole machine), mounts {n1 - n0:+,}"
            )
            t = time.perf_counter()
            await asyncio.gather(*(pool.destroy(r) for r in held))
            notes[-1] += f"; destroyed in {time.perf_counter() - t:.1f} s"
        shm = "tmpfs" if str(node_root).startswith("/dev/shm/") else "disk"
        d1, r1, dr, slab, shmem, nm, avail = idle[ENV_TASK]
    finally:
        await bus.close()
        node.send_signal(signal.SIGTERM)
        node.wait(60)
        log.close()
        nats.stop()
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
            if not a.env_root:
                shutil.rmtree(env_root, ignore_errors=True)
    print("| operation | p50 ms | p99 ms | n |\n|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| target | measured | met |\n|---|---|---|")
    print(
        f"| create -> `true` -> destroy, environment within 1.5x of text (p50) | {ratio:.2f}x | {'yes' if ratio <= 1.5 else 'no'} |"
    )
    f = fork_p50[ENV_TASK] * 1e3
    print(f"| fork of an environment sandbox, p50 under 20 ms | {f:.2f} ms | {'yes' if f < 20 else 'no'} |")
    print(
        f"| {a.idle} idle environment sandboxes: node folder under 1 GB | {mib(d1)} MiB | {'yes' if d1 * 2**20 < 1e9 else 'no'} |"
    )
    print(
        f"| {a.idle} idle environment sandboxes: memory within 24 GiB (docs/benchmarks.md, env-pool) | "
        f"env-pool RSS {r1:.0f} MiB ({dr:+.0f}), slab {slab:+,.0f} MiB, tmpfs {shmem:+,.0f} MiB | "
        f"{'yes' if (r1 + slab + shmem) < 24 * 1024 else 'no'} |"
    )
    print()
    print("\n".join(notes))
    print(f"node folder on {shm}; mounts per environment sandbox: {nm / max(a.idle, 1):.1f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300, help="samples per latency row")
    ap.add_argument("--idle", type=int, default=1000, help="idle leased sandboxes of each task held at once")
    ap.add_argument("--warm", type=int, default=4, help="envpool.warm_per_task (bench/envpool.py's 4)")
    ap.add_argument("--small", action="store_true", help="a few-file dir repository and iniconfig (the smoke test)")
    ap.add_argument("--sdist", default="pandas==2.2.3", help="the repository: NAME==VERSION of an sdist on the index")
    ap.add_argument(
        "--packages",
        nargs="*",
        help="the virtualenv's packages (default: numpy pandas==2.2.3 scipy pytest; --small: iniconfig)",
    )
    ap.add_argument(
        "--import", dest="import_", help="module the python row imports (default numpy; --small: iniconfig)"
    )
    ap.add_argument("--interpreter", default="python3.11")
    ap.add_argument("--env-root", help="environments root to use (default: a fresh one under /var/tmp, removed after)")
    ap.add_argument("--build-timeout", type=float, default=1800.0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (suite, node log, nats)")
    asyncio.run(main(ap.parse_args()))
