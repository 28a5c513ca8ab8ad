"""env-pool over a real nats-server with the bubblewrap backend: the sandbox lifecycle,
command limits, the tools and their errors, backpressure, leases, warm pools, forks,
snapshots restored on another node, two nodes sharing the queue group while calls
reach each sandbox's owner, and the operator HTTP API."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from harness import InProcessPlatform, experiment, wait_for

from kiln.shared import contracts as c
from kiln.shared.bus import RemoteError
from kiln.shared.envpool_client import EnvPoolClient


@pytest.fixture
async def envpool(nats_server, run_dir):
    exp = experiment(
        run_dir,
        nats_server.url,
        "sqlite://",
        envpool={"max_sandboxes": 3, "reap_interval_s": 0.2, "output_limit_bytes": 2000, "warm_per_task": 0},
    )
    p = InProcessPlatform(exp)
    await p.start("env-pool", instance="node-a")
    yield p
    await p.stop_all()


def call(name, **args) -> c.ToolCall:
    return c.ToolCall(id=f"{name}-{time.monotonic_ns()}", name=name, arguments=args)


async def test_lifecycle_exec_and_limits(envpool, bus):
    pool = EnvPoolClient(bus)
    ref = await pool.create("fix-calc")
    assert ref.node_id == "node-a"
    r = await pool.exec(ref, "ls; echo err >&2; exit 3", 10)
    assert r.exit_code == 3 and "calc.py" in r.stdout and "test_calc.py" in r.stdout and r.stderr.strip() == "err"
    r = await pool.exec(ref, "env", 10)
    assert "NATS" not in r.stdout and "KILN" not in r.stdout and "HOME=" in r.stdout  # cleared environment

    # A timeout kills the whole process group, background children included: the call
    # returns long before the sleeps' 100 s (a loose bound: the machine's speed must not matter).
    t0 = time.monotonic()
    r = await pool.exec(ref, "sleep 100 & sleep 100; echo never", 0.5)
    assert r.timed_out and r.exit_code == -9 and time.monotonic() - t0 < 50 and "never" not in r.stdout
    assert "timeout" in r.stderr
    # Output is capped: head and tail kept, the cut marked.
    r = await pool.exec(ref, "echo START; yes x | head -c 200000; echo; echo END", 10)
    assert (
        r.truncated and r.stdout.startswith("START") and r.stdout.rstrip().endswith("END") and "truncated" in r.stdout
    )
    assert len(r.stdout) < 3000

    assert await pool.destroy(ref) is True
    assert await pool.destroy(ref) is False
    with pytest.raises(RemoteError) as e:
        await pool.exec(ref, "true", 5)
    assert e.value.code == "not_found"


async def test_tools_and_their_errors(envpool, bus):
    pool = EnvPoolClient(bus)
    ref = await pool.create("fix-calc")
    calls = [
        call("read_file", path="calc.py"),
        call("read_file", path="calc.py", start_line=2, end_line=2),
        call("list_dir"),
        call("edit_file", path="calc.py", old="a - b", new="a + b"),
        call("edit_file", path="calc.py", old="not there", new="x"),
        call("edit_file", path="test_calc.py", old="self", new="x"),
        call("edit_file", path="new/mod.py", old="", new="X = 1\n"),
        call("write_file", path="notes.txt", content="hello"),
        call("run_terminal_cmd", command="python3 -m unittest -q test_calc 2>&1 | tail -1; cat new/mod.py notes.txt"),
        call("read_file", path="../../etc/passwd"),
        call("read_file", path="/etc/passwd"),
        call("read_file", path="missing.py"),
        call("run_terminal_cmd", command="ln -s /etc escape"),
        call("read_file", path="escape/passwd"),
        call("frobnicate", x=1),
        call("read_file", paht="calc.py"),
    ]
    res = await pool.tools(ref, calls)
    assert [r.call_id for r in res] == [cl.id for cl in calls]
    out = [(r.output, r.error) for r in res]
    assert out[0][0] == "def add(a, b):\n    return a - b\n"
    assert out[1][0] == "    return a - b\n"
    assert out[2][0].split("\n") == ["calc.py", "test_calc.py"]
    assert out[3] == ("edited calc.py", None)
    assert "not found" in out[4][1]
    assert "occurs" in out[5][1] and "unique" in out[5][1]
    assert out[6][0] == "created new/mod.py"
    assert out[7][0].startswith("wrote 5")
    assert "OK" in out[8][0] and "X = 1" in out[8][0] and "hello" in out[8][0]
    assert "'..'" in out[9][1]
    assert "relative" in out[10][1]
    assert "no such file" in out[11][1]
    assert "outside the workspace" in out[13][1]
    assert "unknown tool" in out[14][1]
    assert "bad arguments" in out[15][1]


async def test_batch_results_come_back_in_call_order(envpool, bus):
    pool = EnvPoolClient(bus)
    ref = await pool.create("fix-calc")
    calls = [
        call("run_terminal_cmd", command="sleep 0.3; echo first > order.txt"),
        call("read_file", path="order.txt"),
        call("run_terminal_cmd", command="echo second >> order.txt"),
        call("read_file", path="order.txt"),
    ]
    res = await pool.tools(ref, calls)
    assert [r.call_id for r in res] == [cl.id for cl in calls]
    assert res[1].output == "first\n"  # the write ran before the read that follows it
    assert res[3].output == "first\nsecond\n"


async def test_pool_exhaustion_is_immediate_and_clear(envpool, bus):
    pool = EnvPoolClient(bus)
    refs = [await pool.create("fix-calc") for _ in range(3)]
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as e:
        await pool.create("fix-calc")
    assert e.value.code == "pool_exhausted" and "3 of 3" in e.value.message and time.monotonic() - t0 < 2
    with pytest.raises(RemoteError) as e:
        await pool.create("no-such-task")
    assert e.value.code in ("unknown_task", "pool_exhausted")
    await pool.destroy(refs[0])
    await pool.create("fix-calc")  # room again


async def test_expired_leases_are_reaped(envpool, bus):
    pool = EnvPoolClient(bus)
    ref = await pool.create("fix-calc", ttl_s=0.3)
    keep = await pool.create("fix-calc", ttl_s=600)

    async def gone():
        try:
            await pool.exec(ref, "true", 5)
            return False
        except RemoteError as e:
            return e.code == "not_found"

    await wait_for(gone, 10, 0.2, "lease reaped")
    assert (await pool.exec(keep, "echo alive", 5)).stdout == "alive\n"


async def test_two_nodes_share_creates_and_route_to_owners(envpool, bus):
    await envpool.start("env-pool", instance="node-b")
    pool = EnvPoolClient(bus)
    refs = []
    for _ in range(40):
        ref = await pool.create("fix-calc")
        if ref.node_id in {r.node_id for r in refs}:
            await pool.destroy(ref)
        else:
            refs.append(ref)
        if len(refs) == 2:
            break
    assert {r.node_id for r in refs} == {"node-a", "node-b"}, "the queue group never used both nodes"
    for r in refs:
        await pool.tools(r, [call("write_file", path="me.txt", content=r.sandbox_id)])
    for r in refs:
        out = await pool.exec(r, "cat me.txt", 5)
        assert out.stdout == r.sandbox_id, "a call reached a node that does not own the sandbox"
    health = await bus.request(f"{c.HEALTH_PREFIX}.env-pool", c.HealthProbe(), c.HealthReply)
    assert health.service == "env-pool" and health.detail["ready"] is True
    await asyncio.gather(*(pool.destroy(r) for r in refs))


async def test_fork_snapshot_restore_and_renew(envpool, bus):
    await envpool.start("env-pool", instance="node-b")
    pool = EnvPoolClient(bus)
    ref = await pool.create("fix-calc")
    await pool.tools(
        ref,
        [
            call("edit_file", path="calc.py", old="a - b", new="a + b"),
            call("write_file", path="notes/n.txt", content="n"),
        ],
    )
    child = await pool.fork(ref)
    assert child.node_id == ref.node_id and child.sandbox_id != ref.sandbox_id
    assert (await pool.exec(child, "cat calc.py notes/n.txt", 5)).stdout == "def add(a, b):\n    return a + b\nn"
    await pool.exec(child, "echo changed > notes/n.txt", 5)
    assert (await pool.exec(ref, "cat notes/n.txt", 5)).stdout == "n"  # a fork is a copy, not a view

    snap = await pool.snapshot(ref)
    assert snap.task_id == "fix-calc" and snap.size > 0 and len(snap.sha256) == 64
    await pool.destroy(ref)
    elsewhere = None
    for _ in range(40):  # restore until one lands on the other node: snapshots travel
        r = await pool.create("fix-calc", snapshot_key=snap.key)
        out = await pool.exec(r, "cat calc.py; python3 -m unittest -q test_calc 2>&1 | tail -1", 20)
        assert out.stdout.endswith("OK\n"), out
        if r.node_id != child.node_id:
            elsewhere = r
            break
        await pool.destroy(r)
    assert elsewhere is not None, "no restore ever landed on the other node"
    with pytest.raises(RemoteError) as e:
        await pool.create("fix-calc", snapshot_key="fix-calc/nope")
    assert e.value.code == "not_found"

    soon = time.time() + 1
    expires = await pool.renew(child, 600)
    assert expires > soon + 500
    with pytest.raises(RemoteError):
        await pool.renew(c.SandboxRef(node_id=child.node_id, sandbox_id="sb-none"), 10)


async def test_warm_pool_serves_repeat_tasks(nats_server, bus, run_dir):
    exp = experiment(run_dir, nats_server.url, "sqlite://", envpool={"warm_per_task": 2, "reap_interval_s": 0.1})
    p = InProcessPlatform(exp)
    await p.start("env-pool", instance="warm")
    try:
        pool = EnvPoolClient(bus)
        first = await pool.create("fix-calc")

        async def warmed():
            return (await pool.stats("warm")).idle == 2

        await wait_for(warmed, 10, 0.1, "warm pool filled")
        second = await pool.create("fix-calc")
        st = await pool.stats("warm")
        assert st.leased == 2 and st.idle <= 2 and st.backend == "bwrap"
        assert (await pool.exec(second, "cat calc.py", 5)).stdout == "def add(a, b):\n    return a - b\n"
        await pool.destroy(first)
    finally:
        await p.stop_all()


async def test_http_api(nats_server, bus, run_dir):
    import httpx

    exp = experiment(
        run_dir, nats_server.url, "sqlite://", envpool={"http": {"port": 0, "token": "s3cret"}, "warm_per_task": 0}
    )
    p = InProcessPlatform(exp)
    await p.start("env-pool", instance="web")
    try:
        pool = EnvPoolClient(bus)
        ref = await pool.create("fix-calc")
        await pool.exec(ref, "true", 5)
        url = (await pool.stats("web")).http_url
        assert url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=url) as h:
            assert (await h.get("/healthz")).json()["node_id"] == "web"
            assert (await h.get("/sandboxes")).status_code == 401
            auth = {"Authorization": "Bearer s3cret"}
            listing = (await h.get("/sandboxes", headers=auth)).json()["sandboxes"]
            assert [x["sandbox_id"] for x in listing] == [ref.sandbox_id] and listing[0]["state"] == "leased"
            metrics = (await h.get("/metrics", headers=auth)).text
            assert "kiln_envpool_sandboxes_leased 1.0" in metrics and "kiln_envpool_exec_seconds_count 1.0" in metrics
            assert "kiln_envpool_create_seconds_bucket" in metrics
    finally:
        await p.stop_all()


async def test_wide_http_bind_needs_a_token():
    from kiln.shared.http import serve_http

    with pytest.raises(ValueError, match="token"):
        await serve_http(None, "0.0.0.0", 0, "", asyncio.Event())


async def test_refuses_to_start_without_bubblewrap(nats_server, run_dir, tmp_path, monkeypatch):
    from kiln.envpool.isolation.bwrap import BwrapError, bwrap_binary

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH
    bwrap_binary.cache_clear()
    p = InProcessPlatform(experiment(run_dir, nats_server.url, "sqlite://"))

    try:
        with pytest.raises(BwrapError, match="bubblewrap"):
            await p.start("env-pool")
    finally:
        p.running.clear()
        bwrap_binary.cache_clear()


async def test_two_env_pool_processes_share_load(envpool, bus, run_dir):
    """A second node as its own process (as deployed) joins the queue group."""
    import os
    import subprocess
    import sys

    exp = envpool.experiment_file
    other = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kiln.envpool.main",
            "--config",
            str(exp),
            "--instance",
            "proc-node",
            "--set",
            'envpool.node_id="proc-node"',
        ],
        stdout=open(run_dir / "proc-node.log", "wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "KILN_CONFIG": str(exp)},
    )
    pool = EnvPoolClient(bus)
    try:

        async def up():
            try:
                return (await pool.stats("proc-node")).node_id == "proc-node"
            except RemoteError:
                return False

        await wait_for(up, 60, 0.2, "second env-pool process")
        seen = {}
        for _ in range(40):
            ref = await pool.create("fix-calc")
            if ref.node_id in seen:
                await pool.destroy(ref)
            else:
                seen[ref.node_id] = ref
            if len(seen) == 2:
                break
        assert set(seen) == {"node-a", "proc-node"}
        for node, ref in seen.items():
            await pool.tools(ref, [call("write_file", path="who", content=node)])
            assert (await pool.exec(ref, "cat who", 5)).stdout == node
            await pool.destroy(ref)
    finally:
        other.terminate()
        await asyncio.to_thread(other.wait, 30)
    assert other.returncode == 0, (run_dir / "proc-node.log").read_text()[-2000:]


async def test_a_sandbox_whose_node_files_vanished_is_an_error_not_a_result(envpool, bus):
    """bwrap binds this node's identity files into every sandbox; removed under a running
    node, bwrap would exit before the command and a reward harness would read that as the
    tests failing. The node answers ``sandbox_broken`` instead (reward: ``infra_error``)."""
    import os
    import tempfile
    from pathlib import Path

    pool = EnvPoolClient(bus)
    ref = await pool.create("fix-calc")
    roots = [
        Path(b) / f"node-a-{os.getpid()}"
        for b in ("/dev/shm/kiln-envpool", Path(tempfile.gettempdir()) / "kiln-envpool")
    ]
    passwd = next(r for r in roots if r.is_dir()) / "etc" / "passwd"
    saved = passwd.read_bytes()
    passwd.unlink()
    try:
        with pytest.raises(RemoteError) as e:
            await pool.exec(ref, "true", 5)
        assert e.value.code == "sandbox_broken" and str(passwd) in str(e.value)
    finally:
        passwd.write_bytes(saved)
    assert (await pool.exec(ref, "echo ok", 5)).stdout.strip() == "ok"


async def test_diff_against_the_task(envpool, bus):
    pool = EnvPoolClient(bus)
    ref = await pool.create("fix-calc")
    await pool.tools(
        ref,
        [
            call("edit_file", path="calc.py", old="a - b", new="a + b"),
            call("write_file", path="new/n.py", content="N = 1\n"),
        ],
    )
    await pool.exec(
        ref, "rm test_calc.py; (printf '\\0'; head -c 100 /dev/urandom) > blob.bin; ln -s /etc/passwd link", 5
    )
    d = await pool.diff(ref)
    assert d.changed == {"calc.py": "def add(a, b):\n    return a + b\n", "new/n.py": "N = 1\n"}
    assert d.deleted == ["test_calc.py"] and d.binary == ["blob.bin", "link"]
    # the same changes as a git-style patch: what git apply takes (binary and link included)
    assert "diff --git a/calc.py b/calc.py" in d.patch and "+    return a + b" in d.patch
    assert "deleted file mode 100644" in d.patch and "new file mode 120000" in d.patch
    assert "GIT binary patch" in d.patch and "diff --git a/new/n.py b/new/n.py" in d.patch


async def test_nothing_the_workspace_holds_breaks_the_node(envpool, bus):
    """Paths past PATH_MAX, a tree deeper than Python's recursion limit, tens of thousands
    of files, commands too long for execve, NUL in a path: every one is bounded and
    answered (an observation, a truncated diff), never a failed request."""
    pool = EnvPoolClient(bus)
    ref = await pool.create("fix-calc")
    make = (
        "(n=$(printf 'd%.0s' $(seq 250)); for i in $(seq 20); do mkdir $n && cd $n || exit 1; done; echo x > f) && "
        "mkdir -p $(printf 'a/%.0s' $(seq 1500)) && mkdir junk && cd junk && seq 1 50000 | xargs touch"
    )
    r = await pool.exec(ref, make, 60)
    assert r.exit_code == 0, r.stderr
    assert (await pool.exec(ref, "ls junk | wc -l", 10)).stdout.strip() == "50000"  # usage walked the tree after each
    t0 = time.monotonic()
    d = await pool.diff(ref)
    assert time.monotonic() - t0 < 15
    assert (
        "more than 10000 files" in d.truncated and len(d.changed) <= 10_001
    )  # the walk stops at the first past the bound
    assert {o[:1] for o in d.omitted} == {"a", "d"} and all(
        len(o) <= 1024 + 256 for o in d.omitted
    )  # the first name past the bound
    for cmd in ("echo " + "x" * 200_000, "echo " + "\u00e9" * 60_000, "echo a\0b"):
        r = await pool.exec(ref, cmd, 10)
        assert r.exit_code == 126 and "[not run: the command" in r.stderr, r.stderr
    long, deep, nul = await pool.tools(
        ref,
        [
            call("write_file", path="/".join(["b" * 250] * 5), content=""),
            call("read_file", path="a/" * 200 + "x"),
            call("write_file", path="n\0ul", content=""),
        ],
    )
    assert "workspace paths have at most 1024 characters" in long.error and "128 levels" in deep.error
    assert "NUL" in nul.error
    stats = await pool.stats(ref.node_id)
    assert await pool.destroy(ref)
    await wait_for(lambda: not list(Path(stats.workspace_root, "ws").glob("sb-*")), 30)  # the deep tree is removed too


def test_an_upper_layer_too_deep_for_a_recursive_walk_copies_and_snapshots(tmp_path):
    """A fork's copy and a snapshot of an environment sandbox's upper layer walk it the
    bounded way: a tree 1,500 levels deep (past Python's recursion limit) is cut at the
    depth bound instead of failing the request."""
    from kiln.envpool.workspaces import upper as upp
    from kiln.envpool.workspaces.overlay import copy_upper

    src = tmp_path / "upper"
    (src / "workspace").mkdir(parents=True)
    (src / "workspace" / "kept.py").write_text("x = 1\n")
    subprocess.run(["bash", "-c", "mkdir -p $(printf 'a/%.0s' $(seq 1500))"], cwd=src / "workspace", check=True)
    copy_upper(src, tmp_path / "copy")
    assert (tmp_path / "copy" / "workspace" / "kept.py").read_text() == "x = 1\n"
    data, _ = upp.snapshot(src)
    upp.restore(data, None, tmp_path / "restored", os.getuid(), os.getgid())
    assert (tmp_path / "restored" / "workspace" / "kept.py").read_text() == "x = 1\n"


def test_usage_counts_bytes_past_the_walk_bounds(tmp_path):
    from kiln.envpool.workspaces.walk import usage

    deep = tmp_path.joinpath(*["a"] * 200)
    deep.mkdir(parents=True)
    (deep / "blob").write_bytes(b"x" * (1 << 20))
    assert usage(tmp_path)[0] >= 1 << 20  # no depth hides bytes from the quota


async def test_a_long_call_to_a_node_that_died_or_restarted_ends_at_once(envpool, bus, run_dir):
    """A call waiting on a node that dies is ended by the client's probe (``node_gone``),
    and a sandbox made by an earlier boot of its node is known dead (``node_restarted``),
    instead of each waiting out its call's whole timeout (300 s here, past the test's)."""
    import os
    import signal
    import subprocess
    import sys

    pool = EnvPoolClient(bus, probe_s=0.5)
    ref = await pool.create("fix-calc")
    assert ref.boot and ref.boot == (await pool.stats(ref.node_id)).boot
    with pytest.raises(RemoteError) as e:
        await pool.exec(ref.model_copy(update={"boot": "an-earlier-boot"}), "sleep 300", 300)
    assert e.value.code == "node_restarted"
    await pool.destroy(ref)

    exp = envpool.experiment_file
    other = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kiln.envpool.main",
            "--config",
            str(exp),
            "--instance",
            "doomed",
            "--set",
            'envpool.node_id="doomed"',
        ],
        stdout=open(run_dir / "doomed.log", "wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "KILN_CONFIG": str(exp)},
    )
    try:

        async def up():
            try:
                return (await pool.stats("doomed")).node_id == "doomed"
            except RemoteError:
                return False

        await wait_for(up, 60, 0.2, "the doomed env-pool process")
        while (doomed := await pool.create("fix-calc")).node_id != "doomed":
            await pool.destroy(doomed)
        root = Path((await pool.stats("doomed")).workspace_root)
        call = asyncio.create_task(pool.exec(doomed, "touch started-by-the-call; sleep 300", 300))
        await wait_for(lambda: any(root.rglob("started-by-the-call")) or call.done(), 60, 0.1, "the call to start")
        other.send_signal(signal.SIGKILL)
        with pytest.raises(RemoteError) as e:
            await call
        assert e.value.code == "node_gone", e.value
    finally:
        other.kill()
        await asyncio.to_thread(other.wait, 30)
