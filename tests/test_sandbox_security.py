"""The bubblewrap sandbox against real attacks, through a real env-pool node over a real
nats-server: no network (not even the NATS port on the host's loopback), no view of the
host or of other sandboxes, no host path inside, a seccomp filter (no new namespaces,
ptrace or mount), no writes outside the workspace, and a fork bomb, a memory
hog, an infinite loop, a 1 GB output and two disk fillers each contained while the node
keeps serving another sandbox. Path escapes are refused by every file tool."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import pytest
from harness import InProcessPlatform, experiment, wait_for

from kiln.shared import contracts as c
from kiln.shared.envpool_client import EnvPoolClient

MiB = 1024 * 1024
LIMITS = {
    "backend": "bwrap",
    "memory_bytes": 160 * MiB,
    "pids": 64,
    "max_file_bytes": 16 * MiB,
    "workspace_quota_bytes": 48 * MiB,
    "output_kill_bytes": 4 * MiB,
    "tmp_bytes": 16 * MiB,
    "cpu_seconds": 20,
    "warm_per_task": 0,
}


@pytest.fixture
async def node(nats_server, bus, run_dir):
    p = InProcessPlatform(experiment(run_dir, nats_server.url, "sqlite://", envpool=LIMITS))
    await p.start("env-pool", instance="sec-node")
    pool = EnvPoolClient(bus)
    yield pool, nats_server
    await p.stop_all()


async def alive(pool: EnvPoolClient, ref: c.SandboxRef) -> None:
    """The node still serves other sandboxes promptly."""
    t0 = time.monotonic()
    r = await pool.exec(ref, "echo still-here", 10)
    assert r.stdout == "still-here\n" and time.monotonic() - t0 < 3, r


async def test_no_network_not_even_host_loopback(node):
    pool, nats = node
    ref = await pool.create("fix-calc")
    probe = (
        "import socket\n"
        "for host, port in [('127.0.0.1', %d), ('10.0.0.1', 80), ('8.8.8.8', 53)]:\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=2); print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('blocked', host, type(e).__name__)\n"
    ) % nats.port
    r = await pool.exec(ref, f"python3 -c {shlex.quote(probe)}; cat /proc/net/dev", 20)
    assert "CONNECTED" not in r.stdout and r.stdout.count("blocked") == 3, r
    interfaces = [line.split(":")[0].strip() for line in r.stdout.splitlines() if ":" in line and "|" not in line]
    assert interfaces == ["lo"], r.stdout


async def test_no_view_of_the_host_or_other_sandboxes(node):
    pool, _ = node
    made = await pool.bus.request(c.ENVPOOL_CREATE, c.SandboxCreate(task_id="fix-calc"), c.SandboxCreated)
    a = made.sandbox
    b = await pool.create("fix-calc")
    await pool.exec(b, "echo secret-of-b > secret.txt", 10)
    other = await pool.exec(b, "true", 5)
    assert other.exit_code == 0
    r = await pool.exec(
        a,
        "id -u; ls /; ls /root 2>&1; cat /etc/shadow 2>&1; ls /dev/shm /home 2>&1; "
        "s=secret; grep -rs \"$s-of-b\" / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr 2>/dev/null | head -1; cat /proc/1/cmdline | tr '\\0' ' '",
        30,
    )
    out = r.stdout + r.stderr
    assert r.stdout.splitlines()[0] == "1000"
    top = set(r.stdout.splitlines()[1:10])
    assert "root" not in top and "home" not in top
    assert "No such file" in out and "secret-of-b" not in r.stdout
    assert "bwrap" in r.stdout or "bash" in r.stdout  # pid 1 is the sandbox's own, not the host's init
    if os.geteuid() == 0:  # as root, each sandbox is its own unprivileged host uid
        owners = {os.stat(os.path.join(root, f)).st_uid for root, _, files in os.walk(made.workspace) for f in files}
        assert owners and 0 not in owners


SYSCALL_PROBE = r"""
import ctypes, errno, os, threading, time
libc = ctypes.CDLL(None, use_errno=True)
def err(r):
    return f"{r} {errno.errorcode.get(ctypes.get_errno()) if r == -1 else 'ok'}"
child = os.fork()  # its own child: only seccomp stops a ptrace of it (same uid, dumpable)
if child == 0:
    time.sleep(30)
    os._exit(0)
print("ptrace", err(libc.ptrace(16, child, 0, 0)))  # PTRACE_ATTACH
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
print("process_vm_readv", err(libc.process_vm_readv(child, iov, 1, iov, 1, 0)))
os.kill(child, 9)
print("mount", err(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)))
print("unshare", err(libc.unshare(0x10000000)))  # CLONE_NEWUSER
print("clone", err(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)))  # clone(CLONE_NEWUSER | SIGCHLD)
print("personality-query", libc.personality(0xFFFFFFFF))
print("personality-no-aslr", err(libc.personality(0x0040000)))
t = threading.Thread(target=print, args=("thread ok",))  # clone3 is ENOSYS: glibc falls back to clone
t.start()
t.join()
"""


async def test_seccomp_denies_namespaces_ptrace_and_mounts(node):
    """A seccomp filter is on every command: no new user namespace (the way back to
    capabilities), no ptrace or reading another process's memory, no mount, no unsafe
    personality, no foreign ABI (an x32 syscall kills); threads and ordinary work still run."""
    pool, _ = node
    ref = await pool.create("fix-calc")
    r = await pool.exec(
        ref,
        f"grep Seccomp: /proc/self/status; unshare -U true; echo unshare-U=$?; unshare -r true; echo unshare-r=$?; "
        f"python3 -c {shlex.quote(SYSCALL_PROBE)}; "
        "python3 -c 'import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39)'; echo x32=$?; "  # x32 getpid
        "setarch -R true; echo setarch-R=$?; echo 'print(6 * 7)' > a.py && python3 a.py",
        30,
    )
    out = r.stdout
    assert "Seccomp:\t2" in out, r
    assert "unshare-U=1" in out and "unshare-r=1" in out and "Operation not permitted" in r.stderr, r
    for call in ("ptrace", "process_vm_readv", "mount", "unshare", "clone"):
        assert f"\n{call} -1 EPERM\n" in out, (call, r)
    assert "personality-query 0\n" in out and "personality-no-aslr -1 EPERM" in out, r
    assert "thread ok" in out, r
    assert "x32=159" in out, r  # 128 + SIGSYS: the process is killed, not just refused
    assert "setarch-R=0" not in out and out.endswith("\n42\n"), r


async def test_no_host_path_inside(node):
    """Nothing a sandboxed process can read names the node's folder (``<base>/<node>-<pid>``):
    not pid 1's argv or environment (the command is pid 1: no bwrap process inside), not any
    visible process's, not its open fds, not the cgroup, not mountinfo: as root, the node's
    workspaces are a tmpfs of their own, so the ``/workspace`` line shows ``/<sandbox id>``
    (a bind shows its source's path inside its filesystem: on ``/dev/shm`` it would name
    ``/kiln-envpool/<node>-<pid>/ws/<sandbox>``)."""
    pool, _ = node
    made = await pool.bus.request(c.ENVPOOL_CREATE, c.SandboxCreate(task_id="fix-calc"), c.SandboxCreated)
    ws = Path(made.workspace)
    token = f"sec-node-{os.getpid()}"  # the node's folder: env-pool runs in this process
    root = next(p for p in ws.parents if p.name == token)
    r = await pool.exec(
        made.sandbox,
        "sleep 5 & for p in /proc/[0-9]*; do echo \"== $p\"; tr '\\0' ' ' < $p/cmdline; echo; tr '\\0' ' ' < $p/environ; echo; "
        "ls -l $p/fd; done; cat /proc/self/mountinfo /proc/self/cgroup /proc/self/mounts; kill %1",
        20,
    )
    out = r.stdout
    assert "== /proc/1\nbash -c sleep 5" in out, r  # pid 1 is the command itself
    assert "bwrap" not in out and "/dev/shm" not in out and str(root) not in out, r
    leaks = [line for line in out.splitlines() if token in line]
    if os.geteuid() == 0:
        assert not leaks, leaks
        line = next(x for x in out.splitlines() if x.split()[4:5] == ["/workspace"])
        assert line.split()[3] == f"/{made.sandbox.sandbox_id}", line
    else:  # without root no tmpfs of its own: the bind's source path inside /dev/shm shows
        assert len(leaks) == 1 and leaks[0].split()[4] == "/workspace", leaks


async def test_cannot_write_outside_the_workspace(node):
    pool, _ = node
    ref = await pool.create("fix-calc")
    r = await pool.exec(
        ref, "touch /usr/x 2>&1; touch /x 2>&1; touch /etc/x 2>&1; echo t > /tmp/t; echo w > w.txt; ls", 10
    )
    assert r.stdout.count("Read-only file system") + r.stdout.count("Permission denied") >= 3, r
    assert "w.txt" in r.stdout
    r = await pool.exec(ref, "cat /tmp/t 2>&1", 10)
    assert "No such file" in r.stdout  # /tmp is private to each command


async def test_fork_bomb_is_contained(node):
    pool, _ = node
    ref, other = await pool.create("fix-calc"), await pool.create("fix-calc")
    r = await pool.exec(ref, "bomb() { bomb | bomb & }; bomb; sleep 3; echo survived", 8)
    assert "Resource temporarily unavailable" in r.stderr or r.timed_out or "retry" in r.stderr, r
    await alive(pool, other)
    await alive(pool, ref)  # the sandbox itself is usable again: nothing of the bomb is left


async def test_memory_hog_is_killed(node):
    pool, _ = node
    ref, other = await pool.create("fix-calc"), await pool.create("fix-calc")
    r = await pool.exec(ref, "python3 -c 'b = bytearray(1024 * 1024 * 1024); print(len(b))'", 30)
    assert r.exit_code != 0 and "1073741824" not in r.stdout, r
    if (await pool.stats("sec-node")).cgroups != "none":
        assert "ran out of memory" in r.stderr, r
    await alive(pool, other)


async def test_infinite_loop_times_out(node):
    pool, _ = node
    ref, other = await pool.create("fix-calc"), await pool.create("fix-calc")
    t0 = time.monotonic()
    r = await pool.exec(ref, "while true; do :; done", 1.0)
    assert r.timed_out and time.monotonic() - t0 < 4
    await alive(pool, other)


async def test_gigabyte_of_output_is_cut_off(node):
    pool, _ = node
    ref, other = await pool.create("fix-calc"), await pool.create("fix-calc")
    t0 = time.monotonic()
    r = await pool.exec(ref, "yes kiln | head -c 1000000000; echo done", 60)
    assert r.exit_code == -9 and "wrote more than" in r.stderr and r.truncated
    assert len(r.stdout) < 100_000 and time.monotonic() - t0 < 20
    await alive(pool, other)


async def test_disk_fillers_are_contained(node):
    pool, _ = node
    ref, other = await pool.create("fix-calc"), await pool.create("fix-calc")
    r = await pool.exec(ref, "head -c 100000000 /dev/zero > big; echo rc=$?; stat -c %s big", 30)
    assert "File size limit exceeded" in r.stderr and r.stdout.splitlines()[-1] == str(16 * MiB), r  # RLIMIT_FSIZE
    await pool.exec(ref, "rm big", 5)
    # Many files under the size limit: the quota check stops the sandbox after the command
    # (and on a tmpfs workspace the memory cgroup bounds it during the command).
    r = await pool.exec(ref, "for i in $(seq 1 12); do head -c 8000000 /dev/zero > f$i || break; done; echo end", 30)
    assert "over its" in r.stderr, r
    r2 = await pool.exec(ref, "echo more", 5)
    assert r2.exit_code == -1 and "over its" in r2.stderr and r2.stdout == ""
    (w,) = await pool.tools(ref, [c.ToolCall(id="w", name="write_file", arguments={"path": "x", "content": "y"})])
    assert "quota" in w.error
    await alive(pool, other)


async def test_every_file_tool_refuses_escapes(node):
    pool, _ = node
    ref = await pool.create("fix-calc")
    await pool.exec(
        ref, "ln -s /etc etc_link; ln -s /etc/passwd pw_link; mkdir d; ln -s ../../.. d/up; mkfifo pipe", 10
    )
    bad = ["../x", "/etc/passwd", "etc_link/passwd", "pw_link", "d/up/etc"]
    calls = []
    for p in bad:
        calls += [
            c.ToolCall(id=f"r{p}", name="read_file", arguments={"path": p}),
            c.ToolCall(id=f"e{p}", name="edit_file", arguments={"path": p, "old": "a", "new": "b"}),
            c.ToolCall(id=f"w{p}", name="write_file", arguments={"path": p, "content": "x"}),
            c.ToolCall(id=f"l{p}", name="list_dir", arguments={"path": p}),
            c.ToolCall(id=f"g{p}", name="grep", arguments={"pattern": "root", "path": p}),
        ]
    calls += [
        c.ToolCall(id="fifo-read", name="read_file", arguments={"path": "pipe"}),
        c.ToolCall(id="fifo-write", name="write_file", arguments={"path": "pipe", "content": "x"}),
        c.ToolCall(id="grep-all", name="grep", arguments={"pattern": "root:x:0"}),
        c.ToolCall(id="search", name="semantic_search", arguments={"query": "root password shell"}),
        c.ToolCall(id="ls", name="list_dir", arguments={"path": "."}),
    ]
    t0 = time.monotonic()
    res = {r.call_id: r for r in await pool.tools(ref, calls, timeout_s=60)}
    assert time.monotonic() - t0 < 30  # nothing blocked on the FIFO
    for p in bad:
        for kind in "rewlg":
            assert res[f"{kind}{p}"].error, f"{kind} {p}: {res[f'{kind}{p}']}"
    assert res["fifo-read"].error and res["fifo-write"].error
    assert "root:x:0" not in (res["grep-all"].output or "")
    assert "root:x:0" not in (res["search"].output or "")
    assert "etc_link@" in res["ls"].output and "pw_link@" in res["ls"].output


async def other_env_pool(script: str, ready: Path):
    """A second process that runs ``script`` (which writes what it made to ``ready``) and then
    lives until it is killed (or this process is gone: it waits on its stdin), once ``ready``
    has it: (the process, the lines it wrote)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", script + "\nimport sys\nsys.stdin.read()\n"], stdin=subprocess.PIPE)

    def written():
        assert child.poll() is None, f"the other env-pool exited with {child.returncode}"
        return ready.exists() and ready.read_text()

    try:
        await wait_for(written, 60, 0.05, "the other env-pool ready")
    except BaseException:
        child.kill()
        child.communicate()
        raise
    return child, ready.read_text().splitlines()


async def test_env_pools_with_one_node_id_do_not_share_cgroups(tmp_path):
    """Two env-pools named alike on one host (two local runs, a test beside a run): one's
    shutdown must not remove the other's cgroups and kill its sandboxes."""
    from kiln.envpool.isolation.cgroups import CgroupManager

    mine = CgroupManager("same-node")
    if mine.mode == "none":
        pytest.skip(f"no writable cgroup hierarchy here: {mine.reason}")
    ready = tmp_path / "ready"
    child, lines = await other_env_pool(
        (
            "import pathlib\n"
            "from kiln.envpool.isolation.cgroups import CgroupManager\n"
            "m = CgroupManager('same-node'); m.create('sb-other', memory_bytes=1 << 28, pids=64)\n"
            f"pathlib.Path({str(ready)!r}).write_text('\\n'.join(map(str, m.parents)))\n"
        ),
        ready,
    )
    try:
        theirs = [Path(p) for p in lines]
        assert theirs and set(theirs).isdisjoint(mine.parents)
        mine.create("sb-mine", memory_bytes=1 << 28, pids=64)
        mine.close()
        assert all((p / "sb-other").is_dir() for p in theirs), "closing one env-pool removed another's sandbox cgroups"
    finally:
        child.kill()
        child.communicate()
    # The dead one's groups are reaped by the next env-pool that starts.
    CgroupManager("another-node").close()
    assert not any(p.exists() for p in theirs)


async def test_env_pools_with_one_node_id_do_not_share_workspaces(tmp_path):
    """The same for the workspace folder: one's shutdown removes its own folder (with the
    bwrap identity files every sandbox binds), never another's; a dead one's is reaped."""
    import shutil

    from kiln.envpool.config import EnvPoolSettings
    from kiln.envpool.main import workspace_root

    node = f"same-node-{tmp_path.name[-8:]}"
    ready = tmp_path / "ready"
    child, lines = await other_env_pool(
        (
            "import pathlib\n"
            "from kiln.envpool.config import EnvPoolSettings\n"
            "from kiln.envpool.main import workspace_root\n"
            f"root = workspace_root(EnvPoolSettings(), '', {node!r}); (root / 'etc').mkdir(parents=True)\n"
            "(root / 'etc' / 'passwd').write_text('x')\n"
            f"pathlib.Path({str(ready)!r}).write_text(str(root))\n"
        ),
        ready,
    )
    try:
        theirs = Path(lines[0])
        mine = workspace_root(EnvPoolSettings(), "", node)
        assert mine != theirs and mine.parent == theirs.parent
        mine.mkdir()
        shutil.rmtree(mine)  # what ``SandboxPool.close`` does
        assert (theirs / "etc" / "passwd").is_file(), "one env-pool's shutdown removed another's files"
        assert workspace_root(EnvPoolSettings(), "", node) == mine and theirs.is_dir(), (
            "a live env-pool's folder was reaped"
        )
    finally:
        child.kill()
        child.communicate()
    workspace_root(EnvPoolSettings(), "", node)
    assert not theirs.exists(), "the dead env-pool's folder was not reaped"
