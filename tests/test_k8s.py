"""The Kubernetes manifests of deploy/k8s, checked offline: every object against the
Kubernetes JSON schemas (``kubernetes-validate``, strict: an unknown field fails), and
against kiln itself, which a schema cannot know:

- every service of docker-compose.yml built from a kiln Dockerfile has a workload, with
  the same image and (rollout-eval) the same role;
- every ``KILN_*`` variable a container gets names a setting its own service reads, and
  each service's settings load from that environment and the experiment ConfigMap;
- credentials (NATS users and passwords, tokens, the database URL) only come from
  Secrets, which ``make_secrets.py`` generates, one NATS user per service with the
  subject permissions of ``kiln.shared.bus.auth`` (also in nats-values.yaml);
- pods meet Pod Security "restricted" (non-root, no privilege escalation, no
  capabilities, RuntimeDefault seccomp), except what env-pool's sandboxes need, which
  is named and justified on the pod and nowhere else;
- probes reach the health endpoints or files the services really serve; ports, Services,
  volumes and claims line up; env-pool has no egress but NATS and DNS.

The YAML is read directly (no kustomize binary): the kustomization's ``images`` are
applied by hand, its other transformers are not used.
"""

from __future__ import annotations

import os
import runpy
import tomllib
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import kubernetes_validate  # requirements-dev.txt: the schemas ship inside it (offline)
import pytest
import yaml
from compose_spec import COMPOSE_FILE, _interpolate, _MigrateConfig, _resolve_env_key

from kiln.shared.bus.auth import ADMIN, denied
from kiln.shared.config import load_config
from kiln.shared.registry import discover

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.33"
"""Schemas validated against: ``hostUsers`` with ``procMount: Unmasked`` (env-pool) needs 1.33."""
KILN_UID = 10001
"""The user every kiln image runs as (deploy/docker/Dockerfile)."""
JUSTIFIED = {"env-pool"}
"""The one workload that may relax the restricted profile (its annotation says why)."""
PRIVILEGES_ANNOTATION = "kiln.dev/privileges"
SECRET_NAMES = ("PASSWORD", "TOKEN", "SECRET")
CREDENTIAL_KEYS = {"KILN_DATABASE__URL", "KILN_NATS__USER"}
NOT_SETTINGS = {"KILN_CONFIG", "KILN_DASHBOARD_TOKEN"}
"""``KILN_*`` names that are not settings fields: the experiment file, ``kiln dashboard``'s token."""
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization) -> list[dict]:
    out = []
    for name in kustomization["resources"]:
        assert (K8S / name).is_file(), f"kustomization.yaml lists {name}, which does not exist"
        out += _docs(K8S / name)
    return out


@pytest.fixture(scope="module")
def generated_secrets() -> list[dict]:
    return runpy.run_path(str(K8S / "make_secrets.py"))["generate"]("postgresql://kiln:pw@postgres.example:5432/kiln")


@pytest.fixture(scope="module")
def registry():
    return discover()


@pytest.fixture(scope="module")
def compose() -> dict:
    return _interpolate(yaml.safe_load(COMPOSE_FILE.read_text()))


def _by_kind(objects, kind) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _workloads(objects) -> dict[str, dict]:
    """Workloads by their ``app.kubernetes.io/name`` label (the compose service name)."""
    return {o["metadata"]["labels"]["app.kubernetes.io/name"]: o for o in objects if o["kind"] in WORKLOAD_KINDS}


def _pod(w: dict) -> dict:
    return w["spec"]["template"]


def _containers(w: dict) -> list[dict]:
    spec = _pod(w)["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def _image(kustomization, image: str) -> tuple[str, str]:
    """(repository, tag) after the kustomization's ``images`` transformer."""
    repo, _, tag = image.partition(":")
    for rule in kustomization.get("images", []):
        if rule["name"] == repo:
            return rule.get("newName", repo), rule.get("newTag", tag)
    return repo, tag


def _env(objects, container: dict) -> dict[str, dict]:
    """Every variable a container gets: ``{name: {"value": ...} | {"secret": (name, key)}}``."""
    configmaps = _by_kind(objects, "ConfigMap")
    out: dict[str, dict] = {}
    for src in container.get("envFrom", []):
        assert "configMapRef" in src, (
            f"{container['name']}: envFrom {src}: credentials come one by one from secretKeyRef"
        )
        for k, v in configmaps[src["configMapRef"]["name"]]["data"].items():
            out[k] = {"value": v}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = {"value": e["value"]}
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            out[e["name"]] = {"secret": (ref["name"], ref["key"])}
    return out


def _service_of(label: str) -> str:
    return "rollout" if label == "rollout-eval" else label


# ------------------------------------------------------------------------------ schemas


def test_every_object_is_valid_kubernetes(objects, generated_secrets):
    problems = []
    for o in [*objects, *generated_secrets]:
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{o['kind']}/{o['metadata']['name']}: {e.message} at {'/'.join(map(str, e.path))}")
    assert not problems, "\n".join(problems)


def test_every_manifest_is_in_the_kustomization(kustomization):
    listed = set(kustomization["resources"])
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "nats-values.yaml"}
    assert files == listed, f"not in kustomization.yaml: {sorted(files - listed)}; missing: {sorted(listed - files)}"


def test_every_object_is_in_the_kiln_namespace(objects, kustomization):
    assert kustomization["namespace"] == "kiln"
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "kiln", f"{o['kind']}/{o['metadata']['name']}"


# ------------------------------------------------------------------ compose and images


def test_every_kiln_compose_service_has_a_workload_with_its_image(objects, compose, kustomization, registry):
    workloads = _workloads(objects)
    built = {
        n: s for n, s in compose["services"].items() if s.get("build") or str(s.get("image", "")).startswith("kiln/")
    }
    assert set(registry) <= set(built)
    for name, svc in built.items():
        assert name in workloads, f"compose service {name!r} has no workload in deploy/k8s"
        repo, tag = svc["image"].split(":")
        main = _pod(workloads[name])["spec"]["containers"][0]
        assert _image(kustomization, main["image"]) == (repo, tag), (
            f"{name}: {main['image']} is not compose's {svc['image']}"
        )
        if name in registry:  # a service runs its image's own command
            assert "command" not in main and "args" not in main, f"{name} overrides its image's command"
    eval_env = _env(objects, _pod(workloads["rollout-eval"])["spec"]["containers"][0])
    assert eval_env["KILN_ROLLOUT__ROLE"]["value"] == "eval"
    migrate = _pod(workloads["migrate"])["spec"]["containers"][0]
    assert migrate["command"] == compose["services"]["migrate"]["command"]


def test_the_learner_is_one_resumable_stateful_pod_with_a_gpu(objects, registry):
    learner = _workloads(objects)["learner"]
    assert learner["kind"] == "StatefulSet" and learner["spec"]["replicas"] == 1
    assert registry["learner"].config_class()().learner.checkpoint.resume, (
        "a restarted learner must resume (learner.checkpoint.resume)"
    )
    c = _pod(learner)["spec"]["containers"][0]
    assert c["resources"]["limits"].get("nvidia.com/gpu") == "1"
    env = _env(objects, c)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    claims = {t["metadata"]["name"] for t in learner["spec"]["volumeClaimTemplates"]}
    assert mounts.get(env["KILN_LEARNER__CHECKPOINT__DIR"]["value"]) in claims, (
        "checkpoints must be on the pod's own volume"
    )
    service = _by_kind(objects, "Service")[learner["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"


def test_staging_and_store_share_the_run_folder(objects):
    """The learner stages checkpoints and the weights service takes them, by path."""
    workloads = _workloads(objects)
    claims = {}
    for name in ("learner", "weights"):
        pod = _pod(workloads[name])["spec"]
        c = pod["containers"][0]
        env = _env(objects, c)
        run_dir = env["KILN_RUN__DIR"]["value"]
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == run_dir)
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        claims[name] = volume["persistentVolumeClaim"]["claimName"]
        for key in ("KILN_LEARNER__STAGING_DIR", "KILN_WEIGHTS__STORE_DIR"):
            if key in env:
                assert PurePosixPath(run_dir) in PurePosixPath(env[key]["value"]).parents, (
                    f"{name}: {key} is off the run folder"
                )
    assert len(set(claims.values())) == 1, claims
    pvc = _by_kind(objects, "PersistentVolumeClaim")[claims["learner"]]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "two pods mount the run folder"
    assert workloads["weights"]["spec"]["strategy"]["type"] == "Recreate", "one writer of the version store"


def test_volumes_and_claims_exist(objects):
    claims = set(_by_kind(objects, "PersistentVolumeClaim"))
    configmaps = set(_by_kind(objects, "ConfigMap"))
    for name, w in _workloads(objects).items():
        pod = _pod(w)["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        volumes |= {t["metadata"]["name"]: {"pvc": True} for t in w["spec"].get("volumeClaimTemplates", [])}
        for v in volumes.values():
            assert "hostPath" not in v, f"{name} mounts a host path"
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, f"{name}: {v}"
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, f"{name}: {v}"
        for c in _containers(w):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{name}: mounts unknown volume {m['name']}"


# ----------------------------------------------------------------- settings and config


def test_the_experiment_is_configs_tiny(objects):
    cm = _by_kind(objects, "ConfigMap")["kiln-experiment"]
    assert cm["data"]["experiment.toml"] == (ROOT / "configs" / "tiny.toml").read_text(), (
        "config.yaml: copy configs/tiny.toml again"
    )


@pytest.mark.parametrize("name", ["env-pool", "weights", "reward", "rollout", "rollout-eval", "learner", "migrate"])
def test_env_names_are_settings_of_the_service_and_load(objects, registry, name, tmp_path, monkeypatch):
    w = _workloads(objects)[name]
    c = _pod(w)["spec"]["containers"][0]
    env = _env(objects, c)
    cls = _MigrateConfig if name == "migrate" else registry[_service_of(name)].config_class()
    problems = [
        why for k in env if k.startswith("KILN_") and k not in NOT_SETTINGS and (why := _resolve_env_key(k, [cls]))
    ]
    assert not problems, f"{name} ({cls.__name__}):\n" + "\n".join(problems)
    for key in [k for k in os.environ if k.startswith("KILN_")]:
        monkeypatch.delenv(key)
    config_file = None
    for k, v in env.items():
        if k == "KILN_CONFIG":
            mount = next(
                m for m in c["volumeMounts"] if PurePosixPath(m["mountPath"]) in PurePosixPath(v["value"]).parents
            )
            volume = next(x for x in _pod(w)["spec"]["volumes"] if x["name"] == mount["name"])
            data = _by_kind(objects, "ConfigMap")[volume["configMap"]["name"]]["data"]
            config_file = tmp_path / "experiment.toml"
            config_file.write_text(data[PurePosixPath(v["value"]).relative_to(mount["mountPath"]).as_posix()])
        elif k.startswith("KILN_"):
            monkeypatch.setenv(k, v.get("value", "from-a-secret"))
    if "KILN_DATABASE__URL" in env:
        monkeypatch.setenv("KILN_DATABASE__URL", "postgresql://kiln:pw@postgres.example:5432/kiln")
    cfg = load_config(cls, config_file)
    if name != "migrate":
        assert config_file, f"{name} gets no KILN_CONFIG"
        assert cfg.run.id and cfg.run.dir == "/data/run"
        assert urlsplit(cfg.nats.url).hostname == "nats", "the NATS Helm release `nats` (nats-values.yaml)"
        assert cfg.telemetry.health_file
    if "database" in cls.model_fields:
        assert cfg.database.url, f"{name} uses the database but gets no URL"


# ---------------------------------------------------------------------------- secrets


def _is_credential(key: str) -> bool:
    return key in CREDENTIAL_KEYS or any(s in key for s in SECRET_NAMES)


def test_credentials_only_come_from_secrets(objects, generated_secrets):
    for cm in _by_kind(objects, "ConfigMap").values():
        for k, v in cm["data"].items():
            assert not _is_credential(k), f"ConfigMap {cm['metadata']['name']} holds {k}"
            if k.endswith(".toml"):
                exp = tomllib.loads(v)
                assert not exp.get("nats", {}).get("password") and not exp.get("database", {}).get("url"), k
    made = {s["metadata"]["name"]: s["stringData"] for s in generated_secrets}
    for name, w in _workloads(objects).items():
        for c in _containers(w):
            for k, v in _env(objects, c).items():
                if _is_credential(k):
                    assert "secret" in v, (
                        f"{name}: {k} is written in the manifest; take it from a Secret (secretKeyRef)"
                    )
                if "secret" in v:
                    secret, key = v["secret"]
                    assert key in made.get(secret, {}), (
                        f"{name}: {k} reads {secret}/{key}, which make_secrets.py does not make"
                    )
            if "KILN_NATS__PASSWORD" in (env := _env(objects, c)):
                own = f"kiln-nats-{_service_of(name)}"
                assert env["KILN_NATS__USER"]["secret"] == (own, "user") and env["KILN_NATS__PASSWORD"]["secret"] == (
                    own,
                    "password",
                )
                assert made[own]["user"] == _service_of(name)


def test_nats_users_and_permissions_are_busauth(registry, generated_secrets):
    made = runpy.run_path(str(K8S / "make_secrets.py"))["NATS_USERS"]
    assert sorted(made) == sorted([ADMIN, *registry]), "one NATS user per service and the operator's (busauth.ADMIN)"
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    cfg = values["config"]
    assert cfg["jetstream"]["enabled"] and cfg["jetstream"]["fileStore"]["pvc"]["enabled"]
    assert cfg["cluster"]["enabled"] and cfg["cluster"]["replicas"] >= 3
    env_cm = yaml.safe_load_all((K8S / "config.yaml").read_text())
    kiln_env = next(d for d in env_cm if d["metadata"]["name"] == "kiln-env")["data"]
    assert int(kiln_env["KILN_NATS__REPLICAS"]) == cfg["cluster"]["replicas"], "streams replicated on every NATS server"
    users = {u["user"]: u for u in cfg["merge"]["authorization"]["users"]}
    assert sorted(users) == sorted(made)
    env = values["container"]["env"]
    for name, u in users.items():
        assert u.get("permissions", {}).get("publish", {}).get("deny", []) == denied(name), name
        var = u["password"].removeprefix("<< $").removesuffix(" >>")
        assert u["password"] == f"<< ${var} >>", f"{name}: the password must be a variable of the server's environment"
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": f"kiln-nats-{name}", "key": "password"}


# --------------------------------------------------------------------------- security


def test_pods_are_restricted_but_for_what_sandboxes_need(objects):
    for name, w in _workloads(objects).items():
        pod = _pod(w)
        spec = pod["spec"]
        assert pod["metadata"]["labels"].get("app.kubernetes.io/part-of") == "kiln", (
            f"{name}: the network policies select by it"
        )
        assert spec.get("automountServiceAccountToken") is False, f"{name} needs no API token"
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(flag), f"{name} sets {flag}"
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] and psc["runAsUser"] == KILN_UID, f"{name} must run as the images' kiln user"
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        justified = name in JUSTIFIED and pod["metadata"].get("annotations", {}).get(PRIVILEGES_ANNOTATION, "").strip()
        for c in _containers(w):
            sc = c["securityContext"]
            assert not sc.get("privileged"), f"{name}/{c['name']} is privileged"
            assert sc["allowPrivilegeEscalation"] is False, f"{name}/{c['name']}"
            assert sc["capabilities"] == {"drop": ["ALL"]}, f"{name}/{c['name']}: no capability is needed"
            assert sc.get("runAsUser", KILN_UID) != 0 and sc.get("runAsNonRoot", True), name
            relaxed = [
                k
                for k in ("seccompProfile", "appArmorProfile")
                if sc.get(k, {}).get("type", "RuntimeDefault") != "RuntimeDefault"
            ]
            if sc.get("procMount", "Default") != "Default":
                relaxed.append("procMount")
                assert spec.get("hostUsers") is False, (
                    f"{name}: an unmasked /proc only in a user namespace of the pod's own"
                )
            assert not relaxed or justified, (
                f"{name}/{c['name']} relaxes {relaxed}; only {sorted(JUSTIFIED)} may, with a {PRIVILEGES_ANNOTATION} annotation"
            )


def test_env_pool_can_run_bubblewrap(objects, compose):
    pod = _pod(_workloads(objects)["env-pool"])
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert (
        sc["seccompProfile"]["type"] == "Unconfined"
        and "seccomp=unconfined" in compose["services"]["env-pool"]["security_opt"]
    )
    assert sc["appArmorProfile"]["type"] == "Unconfined" and sc["procMount"] == "Unmasked"
    shm = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory", "workspaces live on a tmpfs at /dev/shm"


def test_every_container_has_requests_and_a_memory_limit(objects):
    for name, w in _workloads(objects).items():
        for c in _containers(w):
            r = c.get("resources", {})
            assert {"cpu", "memory"} <= set(r.get("requests", {})), f"{name}/{c['name']} requests no cpu/memory"
            assert "memory" in r.get("limits", {}), f"{name}/{c['name']} has no memory limit"


# ---------------------------------------------------------------- probes and networking


def _port(c: dict, ref) -> int:
    if isinstance(ref, int):
        return ref
    return next(p["containerPort"] for p in c["ports"] if p["name"] == ref)


@pytest.mark.parametrize("name", ["env-pool", "weights", "reward", "rollout", "rollout-eval", "learner"])
def test_probes_reach_what_the_service_serves(objects, name):
    c = _pod(_workloads(objects)[name])["spec"]["containers"][0]
    env = _env(objects, c)
    probes = [c[p] for p in ("livenessProbe", "readinessProbe", "startupProbe") if p in c]
    assert "livenessProbe" in c, f"{name} has no liveness probe"
    http_port = {"env-pool": "KILN_ENVPOOL__HTTP__PORT", "weights": "KILN_WEIGHTS__HTTP__PORT"}.get(name)
    for p in probes:
        if http_port:  # an unauthenticated /healthz on the operator API
            assert p["httpGet"]["path"] == "/healthz" and _port(c, p["httpGet"]["port"]) == int(
                env[http_port]["value"]
            ), name
        else:  # the health file the service touches every 5 s
            argv = p["exec"]["command"]
            assert argv[:2] == ["kiln", "health"], name
            assert argv[argv.index("--file") + 1] == env["KILN_TELEMETRY__HEALTH_FILE"]["value"].replace(
                "{service}", name
            )
            assert float(argv[argv.index("--max-age") + 1]) > 5
    assert _port(c, "metrics") == int(env["KILN_TELEMETRY__METRICS__PORT"]["value"]), f"{name}: /metrics port"
    assert env["KILN_TELEMETRY__METRICS__TOKEN"].get("secret"), f"{name}: /metrics beyond loopback needs its token"


def test_services_only_for_what_must_be_reachable(objects):
    services = _by_kind(objects, "Service")
    workloads = _workloads(objects)
    assert sorted(services) == ["kiln-dashboard", "kiln-learner", "kiln-weights"], sorted(services)
    for svc in services.values():
        target = workloads[svc["spec"]["selector"]["app.kubernetes.io/name"]]
        c = _pod(target)["spec"]["containers"][0]
        for p in svc["spec"].get("ports", []):
            _port(c, p["targetPort"])  # a named port of the container
    weights = _pod(workloads["weights"])["spec"]["containers"][0]
    url = urlsplit(_env(objects, weights)["KILN_WEIGHTS__PUBLIC_URL"]["value"])
    assert url.hostname == "kiln-weights" and url.port == services["kiln-weights"]["spec"]["ports"][0]["port"]
    for name in ("rollout", "rollout-eval"):
        env = _env(objects, _pod(workloads[name])["spec"]["containers"][0])
        assert env["KILN_WEIGHTS__TRANSPORT__KIND"]["value"] == "http" and env["KILN_WEIGHTS__HTTP__TOKEN"][
            "secret"
        ] == ("kiln-weights-http", "token")


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_env_pool_reaches_nats_and_dns_only(objects):
    labels = _pod(_workloads(objects)["env-pool"])["metadata"]["labels"]
    policies = [p for p in _by_kind(objects, "NetworkPolicy").values() if _selects(p["spec"]["podSelector"], labels)]
    assert any("Egress" in p["spec"]["policyTypes"] and not p["spec"].get("egress") for p in policies), (
        "no default deny"
    )
    for p in policies:
        for rule in p["spec"].get("egress", []):
            assert rule.get("to"), f"{p['metadata']['name']} lets env-pool reach any address"
            ports = {x["port"] for x in rule["ports"]}
            assert ports in ({4222}, {53}), f"{p['metadata']['name']} opens {ports} to env-pool"


def test_every_kiln_pod_is_under_the_default_deny(objects):
    deny = _by_kind(objects, "NetworkPolicy")["kiln-default-deny"]["spec"]
    assert set(deny["policyTypes"]) == {"Ingress", "Egress"} and not deny.get("ingress") and not deny.get("egress")
    for name, w in _workloads(objects).items():
        assert _selects(deny["podSelector"], _pod(w)["metadata"]["labels"]), name


# ------------------------------------------------------------------ the Ray overlay


def test_ray_overlay_launches_the_learner_through_ray(objects, registry, generated_secrets):
    """deploy/k8s/ray: the learner patched to ``launcher.kind = "ray"`` and a KubeRay cluster
    (no schema for its CRD here: checked for what kiln needs of it)."""
    ray_dir = K8S / "ray"
    kz = yaml.safe_load((ray_dir / "kustomization.yaml").read_text())
    assert ".." in kz["resources"]
    patch = _docs(ray_dir / kz["patches"][0]["path"])[0]
    assert (patch["kind"], patch["metadata"]["name"]) == (
        "StatefulSet",
        _workloads(objects)["learner"]["metadata"]["name"],
    )
    c = patch["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    cls = registry["learner"].config_class()
    problems = [why for k in env if k.startswith("KILN_") and (why := _resolve_env_key(k, [cls]))]
    assert not problems, problems
    assert (
        env["KILN_LEARNER__LAUNCHER__KIND"]["value"] == "ray"
        and env["KILN_LEARNER__LAUNCHER__ADDRESS"]["value"] == "auto"
    )
    assert c["command"][-1].endswith("exec python -m " + registry["learner"].module)
    made = {s["metadata"]["name"]: s["stringData"] for s in generated_secrets}
    cluster = _docs(ray_dir / "raycluster.yaml")[0]
    pods = [cluster["spec"]["headGroupSpec"]["template"], *[g["template"] for g in cluster["spec"]["workerGroupSpecs"]]]
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", "the head runs no rank"
    # KubeRay puts RAY_AUTH_MODE=token and the Secret's auth_token into every Ray container.
    assert cluster["spec"]["authOptions"]["mode"] == "token" and env["RAY_AUTH_MODE"]["value"] == "token"
    ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (
        ref == {"name": cluster["spec"]["authOptions"]["secretName"], "key": "auth_token"}
        and ref["key"] in made[ref["name"]]
    )
    for pod in pods:
        rc = pod["spec"]["containers"][0]
        assert rc["image"].split(":")[0] == "kiln/learner"
        assert pod["spec"]["securityContext"]["runAsUser"] == KILN_UID and rc["securityContext"]["capabilities"] == {
            "drop": ["ALL"]
        }
        assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kiln"
    workers = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    checkpoints = PurePosixPath(env["KILN_LEARNER__CHECKPOINT__DIR"]["value"])
    assert any(
        PurePosixPath(m["mountPath"]) in checkpoints.parents for m in workers["containers"][0]["volumeMounts"]
    ), "every rank writes its checkpoint shards: the workers must mount the learner's checkpoint folder"
    for o in _docs(ray_dir / "network-policies.yaml"):
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def test_the_docs_name_every_file():
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    for p in K8S.rglob("*"):
        if p.is_file():
            assert p.relative_to(K8S).as_posix() in doc, (
                f"docs/kubernetes.md does not mention deploy/k8s/{p.relative_to(K8S)}"
            )
    for cmd in ("helm install nats nats/nats", "kubectl apply -k deploy/k8s", "make_secrets.py"):
        assert cmd in doc, cmd
