"""Static checks of the offline compose set-up (scripts/compose-offline.sh,
deploy/docker/compose.offline.yml, deploy/docker/standins.Dockerfile), no Docker needed:
the override swaps in only the stand-in images the script builds, moves jaeger and
grafana to a profile the script leaves off (docker-compose.yml itself keeps them for a
normal machine), and the services that lose the OTLP collector write spans to files."""

from __future__ import annotations

import re

import pytest
import yaml
from compose_spec import COMPOSE_FILE, ROOT, SERVICE_FOLDERS, _depends, _env, _interpolate

OVERRIDE = ROOT / "deploy" / "docker" / "compose.offline.yml"
STANDINS = ROOT / "deploy" / "docker" / "standins.Dockerfile"
SCRIPT = ROOT / "scripts" / "compose-offline.sh"
STANDIN_SERVICES = ("nats", "postgres", "prometheus")
PROFILED = ("jaeger", "grafana")


@pytest.fixture(scope="module")
def base() -> dict:
    return _interpolate(yaml.safe_load(COMPOSE_FILE.read_text()))


@pytest.fixture(scope="module")
def override() -> dict:
    return _interpolate(yaml.safe_load(OVERRIDE.read_text()))


def test_override_names_only_services_of_the_base_file(base, override):
    extra = set(override["services"]) - set(base["services"])
    assert not extra, f"{OVERRIDE.name} adds services {sorted(extra)}; it only adjusts docker-compose.yml's"


def test_stand_ins_are_the_images_the_script_builds(override):
    targets = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", STANDINS.read_text(), re.M)
    script = SCRIPT.read_text()
    for name in STANDIN_SERVICES:
        image = override["services"][name].get("image")
        assert image == f"kiln-local/{name}:latest", f"{name} runs {image!r} offline"
        assert name in targets, f"{STANDINS.name} has no target {name!r} (targets: {targets})"
        assert override["services"][name].get("pull_policy") == "never", f"{name} would be pulled"
    assert "for t in nats postgres prometheus" in script, "the script does not build every stand-in"
    images = {n for n, s in override["services"].items() if s.get("image")}
    assert images == set(STANDIN_SERVICES), f"{OVERRIDE.name} replaces the images of {sorted(images)}"


def test_jaeger_and_grafana_are_profiled_offline_only(base, override):
    for name in PROFILED:
        assert override["services"][name].get("profiles"), f"{name} is not in a profile offline"
        assert not base["services"][name].get("profiles"), (
            f"docker-compose.yml puts {name} in a profile: a normal `docker compose up` would leave it off"
        )
    for name, svc in base["services"].items():
        if "jaeger" in _depends(svc):
            dep = (override["services"].get(name) or {}).get("depends_on", {}).get("jaeger", {})
            assert dep.get("required") is False, f"{name} requires jaeger, which the offline profile leaves off"


def test_kiln_services_write_spans_to_files_offline(base, override):
    for name in SERVICE_FOLDERS + ["rollout-eval"]:
        env = _env(override["services"].get(name) or {})
        assert env.get("KILN_TELEMETRY__OTLP_ENDPOINT") == "", f"{name} still exports to jaeger offline"
        assert env.get("KILN_TELEMETRY__TRACES_FILE", "").startswith("/tmp/"), (
            f"{name} has no writable traces file offline (rollout mounts run-data read-only)"
        )
        assert override["services"][name].get("pull_policy") == "never", f"{name}'s image would be pulled"
