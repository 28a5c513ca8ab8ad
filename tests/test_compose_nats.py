"""The compose deployment's NATS, checked without a Docker engine: credentials as compose
secrets, TLS, and the three-node cluster of ``docker-compose.cluster.yml`` merged over
``docker-compose.yml`` (as ``docker compose -f a -f b`` merges them).

- every kiln service speaks TLS to NATS with the CA it mounts, logs in as the busauth user
  of its service (an eval worker as rollout) with its own password file, and mounts no
  other service's password; nats runs ``deploy/nats/nats.conf`` with the secrets it needs;
- every secret is declared, lives under the git-ignored ``deploy/secrets/`` and is one
  that ``kiln bus credentials --tls`` writes;
- merged with the cluster file: three nodes, each with its own store volume and server
  name, routes to exactly those three; each kiln service knows all three URLs, declares
  three replicas and waits for every node to be healthy;
- both nats configurations are accepted by a real nats-server (``-t``) with the secrets
  ``kiln bus credentials --tls`` writes (a real start of the single node with them is in
  tests/test_nats_tls.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from compose_spec import COMPOSE_FILE, ROOT, SERVICE_FOLDERS, _env, _interpolate, _service, _volumes

from kiln.ops.embedded import nats_server_binary
from kiln.shared.bus.auth import SECRET_SERVICES
from kiln.shared.config import NatsSettings
from kiln.shared.devtls import DEFAULT_HOSTS

CLUSTER_FILE = ROOT / "docker-compose.cluster.yml"
NODES = ("nats", "nats-2", "nats-3")
SECRETS_DIR = "./deploy/secrets/"
KILN_SERVICES = (*SERVICE_FOLDERS, "rollout-eval")


def _merge(base, override):
    """Compose's merge for what these files use: mappings merge, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return override


@pytest.fixture(scope="module")
def base() -> dict:
    return _interpolate(yaml.safe_load(COMPOSE_FILE.read_text()))


@pytest.fixture(scope="module")
def merged(base) -> dict:
    return _merge(base, _interpolate(yaml.safe_load(CLUSTER_FILE.read_text())))


def _user_of(service: str) -> str:
    return "rollout" if service == "rollout-eval" else service


def _secret_path(name: str) -> str:
    return f"/run/secrets/{name}"


@pytest.mark.parametrize("service", KILN_SERVICES)
def test_service_speaks_tls_with_its_own_credential(base, service):
    svc = _service(base, service)
    env, mounted = _env(svc), set(svc.get("secrets") or [])
    assert urlsplit(env["KILN_NATS__URL"]).scheme == "tls", f"{service}: {env['KILN_NATS__URL']} is not tls://"
    assert env["KILN_NATS__TLS_CA_FILE"] == _secret_path("nats-ca.crt") and "nats-ca.crt" in mounted, service
    user = _user_of(service)
    assert env["KILN_NATS__USER"] == user and user in SECRET_SERVICES, (
        f"{service} logs in as {env.get('KILN_NATS__USER')}"
    )
    assert env["KILN_NATS__PASSWORD_FILE"] == _secret_path(f"nats-{user}.password"), service
    assert "KILN_NATS__PASSWORD" not in env, f"{service}: a password in the environment; use the secret file"
    others = {s for s in mounted if s.endswith(".password")} - {f"nats-{user}.password"}
    assert not others, f"{service} mounts other services' passwords {others}"
    cfg = NatsSettings(
        url=env["KILN_NATS__URL"],
        user=user,
        password_file=env["KILN_NATS__PASSWORD_FILE"],
        tls_ca_file=env["KILN_NATS__TLS_CA_FILE"],
    )
    assert cfg.stream_replicas == 1


def test_nats_runs_its_config_with_the_secrets(base):
    nats = _service(base, "nats")
    argv = nats["command"]
    conf = argv[argv.index("-c") + 1]
    mount = next(m for m in _volumes(nats) if m["type"] == "bind" and conf.startswith(m["target"] + "/"))
    assert mount["read_only"] and (ROOT / mount["source"] / Path(conf).name).is_file(), mount
    text = (ROOT / mount["source"] / Path(conf).name).read_text()
    for secret in ("nats-auth.conf", "nats-server.crt", "nats-server.key"):
        assert secret in text and secret in nats["secrets"], f"nats does not mount or use {secret}"


def test_every_secret_is_declared_and_generated_by_kiln_bus_credentials(base, merged, tmp_path):
    declared = base.get("secrets") or {}
    used = {s for svc in merged["services"].values() for s in svc.get("secrets") or []}
    assert used <= set(declared), f"undeclared secrets: {used - set(declared)}"
    r = subprocess.run(
        [sys.executable, "-m", "kiln.ops.cli", "bus", "credentials", "--out", str(tmp_path), "--tls"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    for name, spec in declared.items():
        assert spec["file"].startswith(SECRETS_DIR), f"secret {name} lives outside {SECRETS_DIR}: {spec['file']}"
        assert (tmp_path / Path(spec["file"]).name).is_file(), (
            f"kiln bus credentials --tls does not write {spec['file']}"
        )
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/secrets/nats-auth.conf"], cwd=ROOT).returncode == 0
    assert ignored, "deploy/secrets/ is not git-ignored: credentials would be committed"


def test_the_cluster_has_three_nodes_with_their_own_stores(merged):
    names, volumes = set(), set()
    for node in NODES:
        svc = _service(merged, node)
        argv = svc["command"]
        assert argv[argv.index("-c") + 1] == "/etc/nats/nats-cluster.conf", f"{node} runs {argv}"
        store = argv[argv.index("-sd") + 1]
        (vol,) = [m["source"] for m in _volumes(svc) if m["target"] == store and m["type"] == "volume"]
        volumes.add(vol)
        names.add(_env(svc)["NATS_SERVER_NAME"])
        assert node in DEFAULT_HOSTS, f"the certificate of kiln bus credentials --tls does not name {node}"
        assert (svc.get("healthcheck") or {}).get("test"), f"{node} has no healthcheck"
        assert not [p for p in svc.get("ports") or [] if not str(p).startswith("127.0.0.1:")], (
            f"{node} publishes beyond loopback"
        )
        assert {"nats-auth.conf", "nats-server.crt", "nats-server.key", "nats-ca.crt"} <= set(svc["secrets"]), node
    assert len(names) == len(volumes) == 3, f"nodes share a server name or a store: {names} {volumes}"
    assert volumes <= set(merged["volumes"]), "a node's store volume is not declared"
    conf = (ROOT / "deploy" / "nats" / "nats-cluster.conf").read_text()
    routes = set(re.findall(r"nats-route://([\w-]+):6222", conf))
    assert routes == set(NODES), f"routes {routes} are not the three nodes"
    assert re.search(r"cluster\s*\{.*verify:\s*true", conf, re.S), "routes do not authenticate each other (tls verify)"


@pytest.mark.parametrize("service", KILN_SERVICES)
def test_cluster_services_know_every_node_and_replicate_three_times(merged, service):
    svc = _service(merged, service)
    env = _env(svc)
    urls = env["KILN_NATS__URL"].split(",")
    assert sorted(urlsplit(u).hostname for u in urls) == sorted(NODES) and all(u.startswith("tls://") for u in urls), (
        urls
    )
    assert env["KILN_NATS__USER"] == _user_of(service) and env["KILN_NATS__PASSWORD_FILE"], (
        "the cluster override lost the credential"
    )
    cfg = NatsSettings(url=env["KILN_NATS__URL"], replicas=int(env["KILN_NATS__REPLICAS"]))
    assert cfg.stream_replicas == len(NODES)
    deps = svc["depends_on"]
    assert all(deps[n]["condition"] == "service_healthy" for n in NODES), (
        f"{service} does not wait for every node: {deps}"
    )


@pytest.mark.parametrize("conf", ["nats.conf", "nats-cluster.conf"])
def test_nats_server_accepts_the_config_with_generated_secrets(tmp_path, conf):
    """As in the container: the config in <root>/etc/nats, the secrets in <root>/run/secrets."""
    secrets = tmp_path / "run" / "secrets"
    r = subprocess.run(
        [sys.executable, "-m", "kiln.ops.cli", "bus", "credentials", "--out", str(secrets), "--tls"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    etc = tmp_path / "etc" / "nats"
    etc.mkdir(parents=True)
    text = (ROOT / "deploy" / "nats" / conf).read_text().replace('"/run/secrets/', f'"{secrets}/')
    (etc / conf).write_text(text)
    r = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(etc / conf)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"NATS_SERVER_NAME": "nats-1", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0 and "is valid" in r.stdout + r.stderr, r.stdout + r.stderr


def test_docker_compose_accepts_the_merged_files():
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    r = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE_FILE), "-f", str(CLUSTER_FILE), "config", "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
