"""Environment sandboxes through a real env-pool node (bubblewrap, overlayfs, a real
uv-built virtualenv, a real nats-server): a task that names an environment runs in a
copy-on-write view of its layers. Nothing is copied at create, no write reaches a layer,
one sandbox never sees another's writes, the quota counts the upper layer only, a fork
shares the environment and copies only the parent's changes, a snapshot resumes on a
second node, the diff is against the repository, and a destroyed sandbox leaves no mount.
Environment sandboxes pass the same isolation checks as plain ones."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from harness import InProcessPlatform, experiment, score_unchanged_and_solved, wait_for, write_suite

from kiln.envpool.workspaces import overlay
from kiln.shared import contracts as c
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.tasks import Task

pytestmark = pytest.mark.skipif(overlay.supported() is not None, reason=str(overlay.supported()))

MiB = 1024 * 1024
BINARY = bytes(range(256)) * 4


def tree_digest(root: Path) -> str:
    """Paths, modes, owners and bytes of every entry under ``root``."""
    h = hashlib.sha256()
    for dirpath, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(dirs + files):
            p = Path(dirpath) / name
            st = p.lstat()
            h.update(f"{p.relative_to(root)}:{st.st_mode}:{st.st_uid}:{st.st_size}".encode())
            if p.is_file() and not p.is_symlink():
                h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    """A repository with a package, an executable script and a binary file; an environment
    with a package the host's python lacks (iniconfig); two tasks over it."""
    root = tmp_path_factory.mktemp("envsuite")
    repo = root / "repo"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_calc.py").write_text("from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    (repo / "run.sh").write_text("#!/bin/sh\necho script-ran\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "blob.bin").write_bytes(BINARY)
    env = {
        "name": "calc-env",
        "repository": {"kind": "dir", "path": str(repo)},
        "python": {"interpreter": "python3.11", "packages": ["iniconfig==2.0.0", "pytest"]},
    }
    tasks = [
        Task(
            id="env-fix",
            problem_statement="add() subtracts",
            files={},
            test_command="python -m pytest -rA -p no:cacheprovider tests",
            fail_to_pass=["tests/test_calc.py::test_add"],
            environment="calc-env",
            solution={"calc/__init__.py": "def add(a, b):\n    return a + b\n"},
        ),
        Task(
            id="env-bugged",
            problem_statement="x",
            files={"calc/extra.py": "X = 1\n"},
            test_command="python -m pytest -q -p no:cacheprovider tests",
            fail_to_pass=["tests/test_calc.py::test_add"],
            environment="calc-env",
        ),
    ]
    return write_suite(root, tasks, [env])


@pytest.fixture(scope="module")
def env_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("environments")


@pytest.fixture
async def node(nats_server, bus, run_dir, suite, env_root):
    envpool = {
        "backend": "bwrap",
        "warm_per_task": 0,
        "workspace_quota_bytes": 24 * MiB,
        "max_file_bytes": 64 * MiB,
        "memory_bytes": 256 * MiB,
        "environments": {"root": str(env_root)},
    }
    p = InProcessPlatform(
        experiment(run_dir, nats_server.url, "sqlite://", envpool=envpool, tasks={"suite": str(suite)})
    )
    yield p
    await p.stop_all()


@pytest.fixture
async def pool(node, bus):
    await node.start("env-pool", instance="env-a")
    return EnvPoolClient(bus)


def layers_of(env_root: Path) -> list[Path]:
    return [p for p in env_root.rglob("*") if p.is_dir() and p.name in ("workspace", "venv")]


async def create(pool: EnvPoolClient, task_id: str) -> tuple[c.SandboxRef, Path]:
    """A sandbox and its workspace's host path (the node reports it at create)."""
    made = await pool.bus.request(c.ENVPOOL_CREATE, c.SandboxCreate(task_id=task_id), c.SandboxCreated)
    return made.sandbox, Path(made.workspace)


async def test_the_environment_runs_inside_and_the_layers_stay_untouched(pool, env_root):
    ref, workspace = await create(pool, "env-fix")
    before = tree_digest(env_root)
    r = await pool.exec(
        ref,
        "python -c 'import iniconfig, sys; print(sys.prefix)'; ./run.sh; sha256sum blob.bin; "
        "stat -c %a run.sh; python -m pytest -q -p no:cacheprovider tests 2>&1 | tail -1",
        120,
    )
    assert r.exit_code == 0, r
    lines = r.stdout.splitlines()
    assert lines[0] == "/opt/kiln/venv" and lines[1] == "script-ran", r.stdout
    assert lines[2].split()[0] == hashlib.sha256(BINARY).hexdigest() and lines[3] == "755"
    assert "1 failed" in lines[-1]  # the task's bug, run by the environment's pytest
    r = await pool.exec(
        ref,
        "echo 'def add(a, b):\n    return a + b' > calc/__init__.py; rm blob.bin; chmod 600 run.sh; "
        "echo new > new.txt; touch /opt/kiln/venv/x 2>&1; python -m pytest -q -p no:cacheprovider tests 2>&1 | tail -1",
        120,
    )
    assert "1 passed" in r.stdout and ("Read-only" in r.stdout or "Permission denied" in r.stdout), r
    assert tree_digest(env_root) == before, "a write reached an environment layer"
    d = await pool.diff(ref)
    assert d.changed == {"calc/__init__.py": "def add(a, b):\n    return a + b\n", "new.txt": "new\n"}
    assert d.deleted == ["blob.bin"] and d.binary == ["run.sh"]  # a mode change is not text
    assert "deleted file mode 100644" in d.patch and "GIT binary patch" in d.patch  # the binary's removal
    assert "diff --git a/run.sh b/run.sh\nold mode 100755\nnew mode 100644" in d.patch  # git keeps only the x bit
    if os.geteuid() == 0:  # the sandbox's own host uid owns what it sees, the layer is root's
        assert os.stat(workspace / "calc" / "__init__.py").st_uid not in (0, os.geteuid())


async def test_task_files_layer_and_sandboxes_do_not_see_each_other(pool):
    a = await pool.create("env-bugged")
    b = await pool.create("env-bugged")
    assert (await pool.exec(a, "cat calc/extra.py", 10)).stdout == "X = 1\n"
    await pool.exec(b, "echo secret-of-b > calc/extra.py; echo s > mine.txt", 10)
    r = await pool.exec(a, "cat calc/extra.py; ls; cat /proc/self/mountinfo; grep Seccomp: /proc/self/status", 10)
    assert "secret-of-b" not in r.stdout and "mine.txt" not in r.stdout
    # the same isolation as plain sandboxes: the seccomp filter, and no host path in the
    # overlay's options (its layers and upper directory reached it as descriptors)
    assert "Seccomp:\t2" in r.stdout
    overlay_line = next(line for line in r.stdout.splitlines() if " /workspace " in line)
    assert "lowerdir+=/," in overlay_line and "kiln" not in overlay_line and "/var/" not in overlay_line, overlay_line
    assert (await pool.exec(b, "cat calc/extra.py", 10)).stdout == "secret-of-b\n"


async def test_quota_counts_the_upper_layer_and_stops_a_filler(pool):
    ref = await pool.create("env-fix")
    # the environment (a virtualenv with pytest) is larger than the quota: only writes count
    r = await pool.exec(ref, "du -sm /opt/kiln/venv | cut -f1; echo ok", 30)
    assert r.stdout.splitlines()[-1] == "ok"
    r = await pool.exec(ref, "head -c 40000000 /dev/zero > fill.bin; echo wrote", 60)
    assert "quota" in (r.stdout + r.stderr), r
    after = await pool.exec(ref, "echo more", 10)
    assert after.exit_code != 0 and "quota" in after.stderr


async def test_fork_shares_the_environment_and_copies_the_changes(pool):
    ref = await pool.create("env-fix")
    await pool.exec(ref, "echo parent > p.txt; rm run.sh", 10)
    child = await pool.fork(ref)
    assert (await pool.exec(child, "cat p.txt; ls run.sh 2>&1", 10)).stdout.startswith("parent\nls: cannot access")
    await pool.exec(child, "echo child > p.txt", 10)
    await pool.exec(ref, "echo later > later.txt", 10)
    assert (await pool.exec(ref, "cat p.txt", 10)).stdout == "parent\n"
    assert "No such file" in (await pool.exec(child, "cat later.txt 2>&1", 10)).stdout
    await pool.exec(child, "mv calc/__init__.py calc/core.py", 10)
    d = await pool.diff(child)
    assert d.changed == {"p.txt": "child\n", "calc/core.py": "def add(a, b):\n    return a - b\n"}
    assert "rename from calc/__init__.py\nrename to calc/core.py" in d.patch  # git-style: a rename, not delete + add


async def test_snapshot_resumes_on_a_second_node(node, pool, bus):
    await node.start("env-pool", instance="env-b")
    ref = await pool.create("env-fix")
    # files named like the snapshot format's markers are the agent's: they delete nothing on restore
    await pool.exec(
        ref,
        "mkdir -p notes && echo kept > notes/n.txt && rm blob.bin && chmod 700 run.sh && "
        "touch .wh.run.sh .wh.. notes/.wh..wh..opq",
        10,
    )
    snap = await pool.snapshot(ref)
    elsewhere = None
    for _ in range(40):  # restore until one lands on the other node: the queue group picks
        r = await pool.create("env-fix", snapshot_key=snap.key)
        out = await pool.exec(
            r, "cat notes/n.txt; ls blob.bin 2>&1; stat -c %a run.sh; python -c 'import iniconfig; print(1)'", 60
        )
        assert out.stdout.splitlines()[0] == "kept" and "cannot access" in out.stdout, out
        assert out.stdout.splitlines()[-2:] == ["700", "1"], out
        if r.node_id != ref.node_id:
            elsewhere = r
            break
        await pool.destroy(r)
    assert elsewhere is not None, "no restore ever landed on the other node"


async def test_destroy_leaves_no_mount(pool):
    ref, workspace = await create(pool, "env-fix")
    folder = str(workspace.parent.parent)  # the sandbox's own folder: upper, work, the idmapped layers, root
    assert folder in Path("/proc/self/mountinfo").read_text()
    await pool.destroy(ref)
    # the teardown finishes in the background (destroy answers first): wait for its effect
    await wait_for(
        lambda: folder not in Path("/proc/self/mountinfo").read_text() and not os.path.exists(folder),
        60,
        what="the view's mounts and folder are gone",
    )


async def test_an_environment_that_cannot_be_built_is_a_clear_error(nats_server, bus, run_dir, tmp_path, env_root):
    bad = {
        "name": "broken",
        "repository": {"kind": "dir", "path": str(tmp_path)},
        "python": {"packages": ["kiln-no-such-package-anywhere==0.0.1"]},
    }
    t = Task(id="t-broken", problem_statement="x", files={"a.py": "1\n"}, fail_to_pass=["x"], environment="broken")
    write_suite(tmp_path, [t], [bad])
    envpool = {"backend": "bwrap", "warm_per_task": 0, "environments": {"root": str(env_root)}}
    p = InProcessPlatform(
        experiment(
            run_dir, nats_server.url, "sqlite://", envpool=envpool, tasks={"suite": str(tmp_path / "suite.toml")}
        )
    )
    await p.start("env-pool", instance="env-c")
    try:
        pool = EnvPoolClient(bus)
        from kiln.shared.bus import RemoteError

        for _ in range(2):  # the failure is remembered: the second create answers at once, the same way
            with pytest.raises(RemoteError) as e:
                await pool.create("t-broken")
            assert e.value.code == "environment_error" and "broken" in str(e.value) and "python" in str(e.value)
    finally:
        await p.stop_all()


async def test_environment_tasks_score_through_reward(nats_server, bus, pg_url, run_dir, suite, env_root):
    """Real reward on environment sandboxes: the unchanged repository scores 0, the
    reference solution written with the agent's own tool scores 1."""
    got, want = await score_unchanged_and_solved(nats_server, bus, pg_url, run_dir, suite, env_root)
    assert got == want


@pytest.mark.timeout(400)
async def test_a_run_sets_aside_an_environment_that_cannot_be_built(
    nats_server, bus, pg_url, run_dir, tmp_path, suite, env_root
):
    """The whole platform on a suite where one environment cannot be built: the first
    group that meets it is dropped as an infra error, its tasks are never dispatched
    again, and the run trains on the other environment's tasks to the end."""
    from sqlalchemy import select

    from kiln.shared.db import Database, Run, TaskGroup
    from kiln.shared.tasks import load_suite

    good = load_suite(str(suite))
    bad_env = {
        "name": "broken",
        "repository": {"kind": "dir", "path": str(tmp_path)},
        "python": {"packages": ["kiln-no-such-package-anywhere==0.0.1"]},
    }
    bad = [
        Task(id=f"t-broken-{i}", problem_statement="x", files={"a.py": "1\n"}, fail_to_pass=["x"], environment="broken")
        for i in range(3)
    ]
    mixed = write_suite(tmp_path, [*good.tasks, *bad], [good.environments["calc-env"].model_dump(mode="json"), bad_env])
    exp = experiment(
        run_dir,
        nats_server.url,
        pg_url,
        tasks={"suite": str(mixed)},
        envpool={"backend": "bwrap", "warm_per_task": 0, "environments": {"root": str(env_root)}},
        learner={"deadline_check_s": 0.5, "tokenizer_corpus_repeats": 1, "max_dropped_groups": 50},
    )
    p = InProcessPlatform(exp)
    run_id = p.config("learner").run.id
    await p.start_all()
    db = Database(pg_url)
    try:

        async def ended():
            assert not p.failed(), p.failed()
            async with db.session() as s:
                run = await s.get(Run, run_id)
            return run is not None and run.status != "running"

        await wait_for(ended, 360, 0.5, "run ended")
        async with db.session() as s:
            run = await s.get(Run, run_id)
            groups = (
                await s.scalars(select(TaskGroup).where(TaskGroup.run_id == run_id).order_by(TaskGroup.dispatched_at))
            ).all()
        assert run.status == "finished", run.detail
        broken = [g for g in groups if g.task_id.startswith("t-broken")]
        assert all(g.status == "dropped" and g.reason == "infra_error" and "broken" in g.detail for g in broken)
        assert sum(g.status == "trained" for g in groups) == 3 * 2
        assert broken, "no broken task was ever dispatched (the seed decides: change the task mix)"
        first_end = min(g.ended_at for g in broken)  # after it, no broken task was dispatched again
        assert all(g.dispatched_at <= first_end for g in broken), [(g.task_id, g.dispatched_at) for g in broken]
    finally:
        await db.close()
        await p.stop_all()
