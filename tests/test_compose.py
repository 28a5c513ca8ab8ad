"""Structural checks of the container deployment: docker-compose.yml (each kiln service
built from its own target of deploy/docker/Dockerfile), validated against the code (the registered services,
their settings classes, their package dependencies) without a Docker engine.

Compose interpolation (``${VAR:-default}``) is resolved with the defaults only, so the
file is checked as shipped, whatever the environment of the test run holds.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml
from compose_spec import (
    COMPOSE_FILE,
    LOOPBACK,
    MIGRATE,
    ROOT,
    RUN_DATA_USERS,
    SCALABLE,
    SERVICE_FOLDERS,
    SERVICES_DIR,
    _build,
    _depends,
    _dockerfile,
    _env,
    _healthcheck_argv,
    _host_path,
    _interpolate,
    _kiln_env,
    _MigrateConfig,
    _resolve_env_key,
    _service,
    _target,
    _volumes,
)

from kiln.shared.config import ServiceConfig, load_config, load_toml
from kiln.shared.registry import ServiceInfo, discover


@pytest.fixture(scope="module")
def compose() -> dict:
    assert COMPOSE_FILE.is_file(), f"{COMPOSE_FILE} is missing"
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), (
        f"{COMPOSE_FILE.name} has no `services:` mapping"
    )
    return _interpolate(data)


@pytest.fixture(scope="module")
def registry() -> dict[str, ServiceInfo]:
    return discover()


def test_every_service_folder_is_a_registered_service(registry):
    assert SERVICE_FOLDERS, f"no service folders with a pyproject.toml under {SERVICES_DIR}"
    assert sorted(registry) == SERVICE_FOLDERS, (
        f"services/ folders {SERVICE_FOLDERS} and the installed kiln.services entry points {sorted(registry)} "
        "differ: each folder must register a service of the same name (pip install -e services/<name>)"
    )


@pytest.mark.parametrize("folder", SERVICE_FOLDERS)
def test_service_is_built_from_its_dockerfile(compose, folder):
    svc = _service(compose, folder)
    built = _build(svc)
    assert built, f"compose service {folder!r} has no `build:` section"
    context, dockerfile = built
    assert context == ROOT, f"compose service {folder!r} builds with context {context}, expected the repository root"
    assert dockerfile == _dockerfile(folder).resolve(), (
        f"compose service {folder!r} builds {dockerfile.relative_to(ROOT)}, expected {_dockerfile(folder).relative_to(ROOT)}"
    )
    assert dockerfile.is_file(), f"compose service {folder!r}: {dockerfile.relative_to(ROOT)} does not exist"
    assert _target(svc) == folder, (
        f"compose service {folder!r} builds target {_target(svc)!r} of {dockerfile.relative_to(ROOT)}, expected {folder!r}"
    )


@pytest.mark.parametrize("folder", SERVICE_FOLDERS)
def test_kiln_service_has_a_healthcheck_on_its_health_file(compose, folder):
    svc = _service(compose, folder)
    hc = svc.get("healthcheck")
    assert isinstance(hc, dict) and not hc.get("disable"), f"compose service {folder!r} has no healthcheck"
    argv = _healthcheck_argv(hc)
    assert argv[:2] == ["kiln", "health"], (
        f"compose service {folder!r}: healthcheck runs {argv}, expected `kiln health --file ...`"
    )
    assert "--file" in argv and argv.index("--file") + 1 < len(argv), (
        f"compose service {folder!r}: healthcheck has no --file"
    )
    health_file = _env(svc).get("KILN_TELEMETRY__HEALTH_FILE", "")
    assert health_file, (
        f"compose service {folder!r} sets no KILN_TELEMETRY__HEALTH_FILE, so nothing writes the file its healthcheck reads"
    )
    checked = argv[argv.index("--file") + 1]
    assert checked == health_file.replace("{service}", folder), (
        f"compose service {folder!r}: healthcheck reads {checked} but the service writes {health_file.replace('{service}', folder)}"
    )
    if "--max-age" in argv:
        max_age = float(argv[argv.index("--max-age") + 1])
        assert max_age > 5, (
            f"compose service {folder!r}: --max-age {max_age} is below the 5 s heartbeat of the health file"
        )


@pytest.mark.parametrize("folder", SERVICE_FOLDERS)
def test_kiln_service_waits_for_healthy_nats(compose, folder):
    deps = _depends(_service(compose, folder))
    assert deps.get("nats") == "service_healthy", (
        f"compose service {folder!r} depends on nats with {deps.get('nats', 'no condition (no dependency)')!r}, "
        "expected condition service_healthy"
    )
    assert (_service(compose, "nats").get("healthcheck") or {}).get("test"), "nats has no healthcheck to be healthy by"
    nats_url = _env(_service(compose, folder)).get("KILN_NATS__URL", "")
    assert urlsplit(nats_url).hostname == "nats", (
        f"compose service {folder!r}: KILN_NATS__URL is {nats_url!r}, expected the nats service (tls://nats:4222)"
    )


def test_nats_runs_jetstream_with_a_volume(compose):
    nats = _service(compose, "nats")
    cmd = nats.get("command")
    argv = cmd if isinstance(cmd, list) else shlex.split(cmd or "")
    assert "-js" in argv or "--jetstream" in argv, f"nats command {argv} does not enable JetStream (-js)"
    assert "-sd" in argv, f"nats command {argv} sets no store directory (-sd)"
    store = argv[argv.index("-sd") + 1]
    assert any(m["target"] == store and m["type"] == "volume" for m in _volumes(nats)), (
        f"nats stores JetStream in {store} but no named volume is mounted there: streams would not survive a restart"
    )


@pytest.mark.parametrize("folder", SERVICE_FOLDERS)
def test_database_users_get_the_url_and_wait_for_migrate(compose, registry, folder):
    cls = registry[folder].config_class()
    svc = _service(compose, folder)
    env = _env(svc)
    if "database" not in cls.model_fields:
        assert "KILN_DATABASE__URL" not in env, (
            f"compose service {folder!r} gets KILN_DATABASE__URL but {cls.__name__} has no database section"
        )
        return
    assert env.get("KILN_DATABASE__URL"), (
        f"{folder} uses the database ({cls.__name__}.database) but gets no KILN_DATABASE__URL"
    )
    assert _depends(svc).get(MIGRATE) == "service_completed_successfully", (
        f"{folder} uses the database but does not depend on {MIGRATE!r} with condition service_completed_successfully"
    )


def test_migrate_upgrades_the_same_database(compose, registry):
    mig = _service(compose, MIGRATE)
    cmd = mig.get("command")
    argv = cmd if isinstance(cmd, list) else shlex.split(cmd or "")
    assert argv[:3] == ["kiln", "db", "upgrade"], f"{MIGRATE} runs {argv}, expected `kiln db upgrade`"
    built = _build(mig)
    assert built and built[1] == _dockerfile("weights").resolve() and _target(mig) == "weights", (
        f"{MIGRATE} is not built from the weights target of {_dockerfile('weights').relative_to(ROOT)}"
    )
    assert _depends(mig).get("postgres") == "service_healthy", f"{MIGRATE} does not wait for postgres (service_healthy)"
    assert str(mig.get("restart", "no")) in ("no", "False", "false", "on-failure"), (
        f"{MIGRATE} is one-shot; restart {mig.get('restart')!r} would rerun it forever"
    )
    urls = {MIGRATE: _env(mig).get("KILN_DATABASE__URL", "")}
    for folder in SERVICE_FOLDERS:
        if "database" in registry[folder].config_class().model_fields:
            urls[folder] = _env(_service(compose, folder)).get("KILN_DATABASE__URL", "")
    assert len(set(urls.values())) == 1, f"services disagree on KILN_DATABASE__URL: {urls}"
    url = urlsplit(urls[MIGRATE])
    pg = _env(_service(compose, "postgres"))
    assert url.scheme.startswith("postgres") and url.hostname == "postgres", (
        f"KILN_DATABASE__URL {urls[MIGRATE]!r} is not the postgres service"
    )
    assert (url.username, url.password, url.path.lstrip("/")) == (
        pg.get("POSTGRES_USER"),
        pg.get("POSTGRES_PASSWORD"),
        pg.get("POSTGRES_DB"),
    ), f"KILN_DATABASE__URL {urls[MIGRATE]!r} does not match postgres's POSTGRES_USER/PASSWORD/DB {pg}"
    hc = _healthcheck_argv(_service(compose, "postgres").get("healthcheck") or {})
    assert hc[:1] == ["pg_isready"], f"postgres healthcheck is {hc}, expected pg_isready"


def test_every_kiln_env_key_is_a_settings_field(compose, registry):
    classes = [info.config_class() for info in registry.values()]
    problems = []
    for name, svc in compose["services"].items():
        for key in _kiln_env(svc):
            why = _resolve_env_key(key, classes)
            if why:
                problems.append(f"{name}: {why}")
    assert not problems, "environment keys that no setting reads:\n" + "\n".join(problems)


def test_every_kiln_env_key_is_read_by_its_own_service(compose, registry):
    """Stricter: a key a service's own settings class ignores is silently dropped there."""
    owners: dict[str, type[ServiceConfig]] = {f: registry[f].config_class() for f in SERVICE_FOLDERS}
    owners[MIGRATE] = _MigrateConfig
    problems = []
    for name, cls in owners.items():
        for key in _kiln_env(_service(compose, name)):
            why = _resolve_env_key(key, [cls])
            if why:
                problems.append(f"{name} ({cls.__name__}): {why}")
    assert not problems, "environment keys the receiving service ignores:\n" + "\n".join(problems)


@pytest.mark.parametrize("folder", SERVICE_FOLDERS)
def test_service_config_resolves_from_the_compose_environment(compose, registry, folder, monkeypatch):
    svc = _service(compose, folder)
    env = _env(svc)
    for key in list(os.environ):
        if key.startswith("KILN_"):
            monkeypatch.delenv(key)
    config_file = None
    for key, val in env.items():
        if key == "KILN_CONFIG":
            config_file = _host_path(svc, val)
            assert config_file, f"{folder}: KILN_CONFIG={val} is not inside any bind mount of the repository"
        elif key.startswith("KILN_"):
            monkeypatch.setenv(key, val)
    cls = registry[folder].config_class()
    try:
        cfg = load_config(cls, config_file)
    except Exception as e:  # the message names the offending setting
        pytest.fail(f"{folder}: {cls.__name__} does not load from the compose environment and {config_file}: {e}")
    assert cfg.run.id, f"{folder}: run.id resolves empty; rollout and learner refuse to start without one"
    assert cfg.run.dir == env.get("KILN_RUN__DIR"), f"{folder}: run.dir resolves to {cfg.run.dir!r}, not KILN_RUN__DIR"
    assert cfg.nats.url == env.get("KILN_NATS__URL"), (
        f"{folder}: nats.url resolves to {cfg.nats.url!r}, not KILN_NATS__URL"
    )
    if "database" in cls.model_fields:
        assert cfg.database.url, f"{folder}: database.url resolves empty"


def test_run_data_is_shared_at_run_dir(compose):
    """Learner stages checkpoints, weights stores versions, rollout reads them, all by
    absolute path: the same volume must sit at the same path, the run.dir, in each."""
    sources = {}
    for name in RUN_DATA_USERS:
        svc = _service(compose, name)
        env = _env(svc)
        run_dir = env.get("KILN_RUN__DIR", "")
        assert run_dir, f"{name} sets no KILN_RUN__DIR"
        mounts = [m for m in _volumes(svc) if m["target"] == run_dir]
        assert mounts and mounts[0]["type"] == "volume" and mounts[0]["source"], (
            f"{name}: no named volume is mounted at its run.dir {run_dir}"
        )
        sources[name] = (mounts[0]["source"], run_dir)
        if name != "rollout":
            assert not mounts[0]["read_only"], f"{name} writes under {run_dir} but mounts it read-only"
        for key in ("KILN_WEIGHTS__STORE_DIR", "KILN_LEARNER__STAGING_DIR"):
            if env.get(key):
                p = PurePosixPath(env[key])
                assert PurePosixPath(run_dir) in p.parents, (
                    f"{name}: {key}={p} is outside the shared volume at {run_dir}"
                )
    assert len(set(sources.values())) == 1, (
        f"weights, learner and rollout must share one volume at one path; they mount {sources}"
    )


def test_scalable_services_have_no_fixed_name_or_host_ports(compose):
    for name in SCALABLE:
        svc = _service(compose, name)
        assert "container_name" not in svc, (
            f"{name} has container_name {svc['container_name']!r}: `--scale {name}=N` would fail"
        )
        assert not svc.get("ports"), f"{name} publishes host ports {svc['ports']}: replicas would collide on them"
        assert svc.get("network_mode") != "host", f"{name} uses network_mode host: replicas would collide on ports"


def _published(port) -> tuple[str | None, str]:
    """(host ip or None, description) of one ``ports:`` entry."""
    if isinstance(port, dict):
        return port.get("host_ip"), str(port)
    s = str(port).split("/")[0]
    if s.startswith("["):
        return s[1 : s.index("]")], str(port)
    parts = s.split(":")
    return (parts[0] if len(parts) == 3 else None), str(port)


def test_published_ports_bind_loopback_only(compose):
    for name, svc in compose["services"].items():
        for port in svc.get("ports") or []:
            ip, desc = _published(port)
            assert ip == LOOPBACK, (
                f"{name}: port {desc!r} is published on {ip or 'every interface'}; bind it to {LOOPBACK} "
                f'(e.g. "{LOOPBACK}:PORT:PORT")'
            )


def test_jaeger_ui_is_published_on_loopback(compose):
    ports = [_published(p) for p in _service(compose, "jaeger").get("ports") or []]
    assert any(desc.startswith(f"{LOOPBACK}:16686:") for _, desc in ports), (
        f"jaeger does not publish its UI on {LOOPBACK}:16686 ({ports})"
    )


def test_named_volumes_are_declared(compose):
    declared = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for m in _volumes(svc):
            if m["type"] == "volume" and m["source"]:
                assert m["source"] in declared, (
                    f"{name} mounts named volume {m['source']!r} which the top-level `volumes:` does not declare"
                )


def test_bind_mounts_exist_in_the_repository(compose):
    for name, svc in compose["services"].items():
        for m in _volumes(svc):
            if m["type"] == "bind":
                host = (ROOT / m["source"]).resolve()
                assert host.exists(), f"{name} bind-mounts {m['source']} which does not exist in the repository"
                assert ROOT in host.parents or host == ROOT, f"{name} bind-mounts {m['source']}, outside the repository"


def test_kiln_config_file_exists_in_the_repository(compose):
    seen = 0
    for name, svc in compose["services"].items():
        value = _env(svc).get("KILN_CONFIG")
        if value is None:
            continue
        seen += 1
        host = _host_path(svc, value)
        assert host, f"{name}: KILN_CONFIG={value} is not inside any bind mount of the repository"
        assert host.is_file(), (
            f"{name}: KILN_CONFIG={value} is {host.relative_to(ROOT)} on the host, which does not exist"
        )
        load_toml(host)  # parses, includes resolved
    assert seen, "no service sets KILN_CONFIG: the experiment file is never read"


def test_urls_point_at_compose_services(compose):
    names = set(compose["services"])
    for name, svc in compose["services"].items():
        for key, val in _kiln_env(svc).items():
            url = urlsplit(val)
            if url.scheme and url.netloc and url.hostname:
                assert url.hostname in names, (
                    f"{name}: {key}={val} points at host {url.hostname!r}, which is no compose service"
                )


def test_docker_compose_accepts_the_file():
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    r = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE_FILE), "config", "--quiet"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, f"docker compose config rejects docker-compose.yml:\n{r.stderr}"


def test_env_pool_can_start_bubblewrap_sandboxes(compose):
    """bwrap needs namespaces (blocked by Docker's default seccomp) and a real /dev/shm."""
    svc = _service(compose, "env-pool")
    opts = set(svc.get("security_opt", []))
    assert "seccomp=unconfined" in opts, "env-pool needs seccomp=unconfined for bubblewrap's namespaces"
    assert "systempaths=unconfined" in opts, (
        "bubblewrap mounts /proc, refused while the container's /proc has masked paths"
    )
    assert "privileged" not in svc and not svc.get("cap_add"), "env-pool must not be privileged"
    size = str(svc.get("shm_size", "64mb")).lower()
    assert size.endswith("gb") or int(re.sub(r"\D", "", size) or 0) >= 1024, "workspaces need more /dev/shm than 64 MB"


# --- Prometheus and Grafana -----------------------------------------------------------

DEPLOY = ROOT / "deploy"


def test_every_kiln_service_exposes_metrics_prometheus_scrapes(compose, registry):
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {}
    for job in prom["scrape_configs"]:
        assert job["authorization"]["type"] == "Bearer", f"{job['job_name']} scrapes without the token"
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                targets[name] = sd["port"]
    assert set(registry) <= set(targets) <= set(compose["services"]), (
        f"Prometheus scrapes {sorted(targets)}, the services are {sorted(registry)}"
    )
    for name, port in targets.items():
        env = _env(_service(compose, name))
        if name == "env-pool":  # its operator API serves /metrics
            assert env["KILN_ENVPOOL__HTTP__PORT"] == str(port) and env["KILN_ENVPOOL__HTTP__TOKEN"]
        else:
            assert env["KILN_TELEMETRY__METRICS__PORT"] == str(port), name
            assert env["KILN_TELEMETRY__METRICS__HOST"] == "0.0.0.0" and env["KILN_TELEMETRY__METRICS__TOKEN"], name
    prometheus = _service(compose, "prometheus")
    assert "METRICS_TOKEN" in str(prometheus["entrypoint"])
    assert _env(prometheus)["METRICS_TOKEN"] == env["KILN_TELEMETRY__METRICS__TOKEN"], (
        "Prometheus scrapes with another token"
    )


def test_grafana_dashboard_queries_only_declared_metrics(compose):
    import json

    from kiln.shared.metrics import exported_names

    sys_path = DEPLOY / "grafana" / "make_dashboard.py"
    board = json.loads((DEPLOY / "grafana" / "dashboards" / "kiln.json").read_text())
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ][0]
    assert ds["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    known = exported_names()
    used = set()
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == ds["uid"], panel["title"]
        for t in panel["targets"]:
            names = set(re.findall(r"\bkiln_[a-z_]+\b", t["expr"]))
            assert names, f"{panel['title']}: {t['expr']} queries no kiln metric"
            assert names <= known, f"{panel['title']} queries undeclared metrics {sorted(names - known)}"
            used |= names
    # The design's list: reward and pass rate, throughput, idle, staleness, queues, groups, sandboxes.
    for needed in (
        "kiln_learner_pass_rate",
        "kiln_learner_trajectories_trained_total",
        "kiln_learner_wait_seconds_total",
        "kiln_learner_staleness_versions_bucket",
        "kiln_queue_pending",
        "kiln_controller_groups_in_flight",
        "kiln_envpool_sandboxes_leased",
        "kiln_envpool_create_seconds_bucket",
        "kiln_rollout_generated_tokens_total",
    ):
        assert needed in used, f"the Grafana dashboard has no panel for {needed}"
    # The committed JSON is what the generator writes.
    import runpy

    assert runpy.run_path(str(sys_path))["dashboard"]() == board, (
        "kiln.json is stale: run deploy/grafana/make_dashboard.py"
    )


def test_every_service_restarts_after_a_crash(compose):
    """As `kiln run` does: a dead service comes back (the learner resumes from its checkpoint)."""
    for folder in SERVICE_FOLDERS:
        policy = str(_service(compose, folder).get("restart", "no"))
        assert policy in ("unless-stopped", "always", "on-failure"), (
            f"{folder} has restart {policy!r}: a crash would end the run"
        )


def _bytes(size: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).strip().lower())
    assert m, f"unreadable size {size!r}"
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]


def test_rollout_services_have_room_in_dev_shm(compose):
    """vLLM's engine puts a 160 MiB ring buffer in /dev/shm (measured, tiny preset): with
    Docker's default 64 MB it does not start."""
    for name in ("rollout", "rollout-eval"):
        size = _bytes(_service(compose, name).get("shm_size", "64mb"))
        assert size >= 512 << 20, f"{name}: shm_size {size >> 20} MiB; vLLM needs more than 160 MiB of /dev/shm"
