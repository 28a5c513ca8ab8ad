"""The compose tier (markers ``compose`` and ``slow``: ``make test-all`` runs it, the
default tier does not; ``pytest -m compose`` runs only it): kiln on Docker Compose for
real, through scripts/compose-offline.sh, which installs the engine and the compose
plugin where they are missing and builds every image locally (no image registry needed).

Invariants checked, each on the smoke preset (configs/smoke.toml) under ``docker compose
up``: the run finishes (the learner exits 0, every task group is trained or dropped with a
reason, every version published); with ``--scale rollout=3 --scale reward=2`` every
replica takes work (trajectories per rollout worker in the database, scored per reward
replica in Prometheus); killed reward, rollout and nats containers come back by their
restart policies and the run still finishes; ``down`` then ``up`` of the same run id
resumes the learner from its checkpoint; with docker-compose.cluster.yml (three NATS
nodes) a killed node costs the run nothing. Skipped, with the reason,
where there is no Docker and the script cannot install it (not root, or no apt-get).
The project is taken down with its volumes afterwards (``down -v``): each test run starts
from empty volumes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compose-offline.sh"
pytestmark = [pytest.mark.compose, pytest.mark.slow]


def _no_docker_reason() -> str | None:
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return None
    if os.geteuid() == 0 and shutil.which("apt-get"):
        return None  # the script installs docker.io and starts dockerd
    return "no Docker engine, and scripts/compose-offline.sh cannot install one here (needs root and apt-get)"


def _compose(*args: str, env: dict, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [str(SCRIPT), "compose", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert r.returncode == 0, f"docker compose {' '.join(args)}: {r.stderr[-2000:]}"
    return r


def _psql(sql: str, env: dict) -> list[list[str]]:
    r = _compose("exec", "-T", "postgres", "psql", "-U", "kiln", "-d", "kiln", "-At", "-F", "\t", "-c", sql, env=env)
    return [line.split("\t") for line in r.stdout.splitlines() if line]


@pytest.fixture(scope="module")
def compose_env():
    why = _no_docker_reason()
    if why:
        pytest.skip(why)
    env = dict(os.environ)
    env.update(
        KILN_EXPERIMENT="smoke.toml",
        # The smoke preset serves with the torch engine: the rollout image needs no vLLM.
        KILN_ROLLOUT_EXTRAS=os.environ.get("KILN_ROLLOUT_EXTRAS", ""),
        COMPOSE_PROJECT_NAME="kiln-pytest",
    )
    yield env
    _compose("down", "-v", "--remove-orphans", env=env, timeout=300, check=False)


CLUSTER_FILES = ("docker-compose.cluster.yml", "deploy/docker/compose.offline.cluster.yml")


def _run_env(
    base: dict, tmp_path: Path, name: str, learner: dict[str, str] | None = None, files: tuple[str, ...] = ()
) -> dict:
    """``base`` for a new run id, with more compose ``files`` and extra learner settings
    (in a compose file of their own) over the two."""
    env = dict(base, KILN_RUN_ID=f"pytest-{name}-{int(time.time())}", KILN_NO_BUILD="1")
    extra = list(files)
    if learner:
        path = tmp_path / f"{name}.yml"
        lines = ["services:", "  learner:", "    environment:"]
        lines += [f'      {k}: "{v}"' for k, v in learner.items()]
        path.write_text("\n".join(lines) + "\n")
        extra.append(str(path))
    if extra:
        env["KILN_COMPOSE_EXTRA"] = " ".join(extra)
    return env


def _smoke(env: dict, *up_args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """``compose-offline.sh smoke``: up (building first unless KILN_NO_BUILD), then the
    learner's exit code as its own."""
    return subprocess.run(
        [str(SCRIPT), "smoke", *up_args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _learner_exit(env: dict) -> int:
    _compose("wait", "learner", env=env, timeout=1200, check=False)
    cid = _compose("ps", "-aq", "learner", env=env).stdout.split()[0]
    r = subprocess.run(["docker", "inspect", "-f", "{{.State.ExitCode}}", cid], capture_output=True, text=True)
    return int(r.stdout.strip())


def _version(env: dict) -> int:
    rows = _psql(f"SELECT coalesce(max(version), -1) FROM policy_versions WHERE run_id = '{env['KILN_RUN_ID']}'", env)
    return int(rows[0][0]) if rows else -1


def _wait_version(env: dict, version: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _version(env) >= version:
            return
        time.sleep(2)
    pytest.fail(f"run {env['KILN_RUN_ID']} did not reach version {version} within {timeout:.0f} s")


def _logs(env: dict, service: str = "learner") -> str:
    return _compose("logs", "--no-color", "--tail", "40", service, env=env, check=False).stdout


def _assert_finished(env: dict, versions: int) -> None:
    run = env["KILN_RUN_ID"]
    groups = _psql(
        f"SELECT status, coalesce(reason, ''), count(*) FROM task_groups WHERE run_id = '{run}' GROUP BY 1, 2", env
    )
    assert groups, f"run {run} has no task groups in the database"
    assert all(st in ("trained", "dropped") and (st == "trained" or reason) for st, reason, _ in groups), groups
    assert _version(env) == versions, f"run {run} published versions up to {_version(env)}, expected {versions}"


@pytest.mark.timeout(3600)
def test_smoke_preset_runs_to_the_end_through_compose(compose_env):
    env = dict(compose_env, KILN_RUN_ID=f"pytest-smoke-{int(time.time())}")
    started = time.monotonic()
    r = _smoke(env, timeout=3300)
    wall = time.monotonic() - started
    assert r.returncode == 0, f"the learner exited {r.returncode} after {wall:.0f} s\n{r.stderr[-3000:]}\n{_logs(env)}"
    _assert_finished(env, 3)
    run = env["KILN_RUN_ID"]
    workers = _psql(f"SELECT worker_id, count(*) FROM trajectories WHERE run_id = '{run}' GROUP BY 1", env)
    assert workers and all(w for w, _ in workers), f"trajectories without a worker: {workers}"


def _prometheus(query: str) -> list[dict]:
    import json
    import urllib.parse
    import urllib.request

    url = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.timeout(1800)
def test_scaled_replicas_all_take_work(compose_env, tmp_path):
    """Three rollout workers and two reward scorers: six groups a step keep every worker
    busy; each rollout worker's trajectories are in the database, each scorer's count is
    in its metrics, scraped by Prometheus."""
    env = _run_env(compose_env, tmp_path, "scale", {"KILN_ALGORITHM__GROUPS_PER_STEP": "6"})
    r = _smoke(env, "--scale", "rollout=3", "--scale", "reward=2")
    assert r.returncode == 0, f"the learner exited {r.returncode}\n{r.stderr[-3000:]}\n{_logs(env)}"
    _assert_finished(env, 3)
    run = env["KILN_RUN_ID"]
    workers = _psql(
        f"SELECT worker_id, count(*) FROM trajectories WHERE run_id = '{run}' AND worker_id <> '' GROUP BY 1", env
    )
    assert len(workers) == 3 and all(int(n) > 0 for _, n in workers), f"trajectories per rollout worker: {workers}"
    scorers = _compose("ps", "-q", "reward", env=env).stdout.split()
    assert len(scorers) == 2, scorers
    deadline = time.monotonic() + 60
    while True:  # Prometheus scrapes every 5 s and finds new containers by DNS every 15 s
        per = {
            s["metric"]["instance"]: float(s["value"][1])
            for s in _prometheus('sum by (instance) (kiln_reward_scored_total{service="reward"})')
        }
        if len([v for v in per.values() if v > 0]) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert len([v for v in per.values() if v > 0]) == 2, f"trajectories scored per reward replica: {per}"
    print(f"trajectories per rollout worker {dict(workers)}, scored per reward replica {per}")


def _restart_count(env: dict, service: str) -> int:
    ids = _compose("ps", "-aq", service, env=env).stdout.split()
    r = subprocess.run(["docker", "inspect", "-f", "{{.RestartCount}}", *ids], capture_output=True, text=True)
    return sum(int(x) for x in r.stdout.split())


def _crash(env: dict, service: str) -> None:
    """Kill one container of ``service`` as a crash would: SIGKILL to its init from the
    host, which its restart policy answers (``docker kill`` counts as a manual stop)."""
    cid = _compose("ps", "-q", service, env=env).stdout.split()[0]
    pid = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", cid], capture_output=True, text=True)
    os.kill(int(pid.stdout.strip()), 9)


def _wait_restarted(env: dict, service: str, before: int, timeout: float = 120) -> None:
    """Until the restart policy has brought ``service`` back (its restart count rose)."""
    deadline = time.monotonic() + timeout
    while _restart_count(env, service) <= before:
        assert time.monotonic() < deadline, f"{service} was not restarted within {timeout:.0f} s\n{_logs(env)}"
        time.sleep(0.5)


@pytest.mark.timeout(1800)
def test_killed_containers_come_back_and_the_run_finishes(compose_env, tmp_path):
    steps = 10
    env = _run_env(compose_env, tmp_path, "chaos", {"KILN_ALGORITHM__STEPS": str(steps)})
    _compose("up", "-d", "--no-build", env=env, timeout=600)
    for service, at in (("reward", 1), ("rollout", 3), ("nats", 5)):
        _wait_version(env, at)
        before = _restart_count(env, service)
        _crash(env, service)
        _wait_restarted(env, service, before)
    rc = _learner_exit(env)
    assert rc == 0, f"the learner exited {rc}\n{_logs(env)}"
    _assert_finished(env, steps)
    restarts = {service: _restart_count(env, service) for service in ("reward", "rollout", "nats")}
    assert all(restarts.values()), f"restarted by their policies: {restarts}"
    groups = _psql(
        f"SELECT status, coalesce(reason, ''), count(*) FROM task_groups WHERE run_id = '{env['KILN_RUN_ID']}' "
        "GROUP BY 1, 2",
        env,
    )
    print(f"restarts {restarts}, groups {groups}")


@pytest.mark.timeout(1800)
def test_down_then_up_resumes_the_run(compose_env, tmp_path):
    steps = 8
    env = _run_env(compose_env, tmp_path, "resume", {"KILN_ALGORITHM__STEPS": str(steps)})
    _compose("up", "-d", "--no-build", env=env, timeout=600)
    _wait_version(env, 3)
    _compose("down", env=env, timeout=300)  # volumes stay: bus, database, run-data
    _compose("up", "-d", "--no-build", env=env, timeout=600)
    rc = _learner_exit(env)
    logs = _compose("logs", "--no-color", "learner", env=env, check=False).stdout
    assert rc == 0, f"the learner exited {rc} after down/up\n{logs[-4000:]}"
    restored = [line for line in logs.splitlines() if "restored the learner's state" in line]
    assert restored, "the learner did not resume from its checkpoint"
    _assert_finished(env, steps)
    print(restored[0][-160:])


@pytest.mark.timeout(1800)
def test_nats_cluster_survives_a_killed_node(compose_env, tmp_path):
    """docker-compose.cluster.yml (three NATS nodes, every stream with three replicas): a
    node killed mid-run comes back, and the run finishes meanwhile."""
    steps = 10
    env = _run_env(compose_env, tmp_path, "cluster", {"KILN_ALGORITHM__STEPS": str(steps)}, CLUSTER_FILES)
    try:
        _compose("up", "-d", "--no-build", env=env, timeout=600)
        _wait_version(env, 3)
        _crash(env, "nats-2")
        rc = _learner_exit(env)
        assert rc == 0, f"the learner exited {rc}\n{_logs(env)}"
        _assert_finished(env, steps)
        assert _restart_count(env, "nats-2") >= 1, "nats-2 was not restarted by its policy"
    finally:  # the cluster's extra nodes and volumes belong to this file set
        _compose("down", "-v", "--remove-orphans", env=env, timeout=300, check=False)
