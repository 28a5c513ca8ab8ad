"""What tests read of the container deployment: docker-compose.yml as shipped (compose
interpolation with every variable unset, so defaults win), its services, their
environments, builds, volumes and healthchecks, and how a ``KILN_*`` key maps onto a
settings field. Shared by test_compose.py, test_compose_nats.py and test_k8s.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, Field

from kiln.shared.config import DatabaseSettings, ServiceConfig

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SERVICES_DIR = ROOT / "services"
SERVICE_FOLDERS = sorted(p.name for p in SERVICES_DIR.iterdir() if (p / "pyproject.toml").is_file())

SCALABLE = ("rollout", "reward", "env-pool")
"""Replicated with ``docker compose up --scale``: no fixed name, no host port."""
NO_TORCH = ("env-pool", "reward", "weights")
"""Services whose image must not carry torch."""
RUN_DATA_USERS = ("weights", "learner", "rollout")
"""Exchange checkpoint and version folders by absolute path under run.dir."""
MIGRATE = "migrate"
LOOPBACK = "127.0.0.1"


class _MigrateConfig(ServiceConfig):
    """What ``kiln db upgrade`` reads (``cmd_db_upgrade`` in kiln.ops.cli)."""

    database: DatabaseSettings = Field(default_factory=DatabaseSettings)


# ---------------------------------------------------------------------------- helpers

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def _interpolate(value: Any) -> Any:
    """Compose variable substitution with every variable unset (defaults win)."""
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        op, arg = m.group(2), m.group(3)
        return arg if op in (":-", "-") else ""

    parts = value.split("$$")
    return "$".join(_VAR.sub(sub, p) for p in parts)


def _service(compose: dict, name: str) -> dict:
    svc = compose["services"].get(name)
    assert isinstance(svc, dict), f"docker-compose.yml has no service {name!r} (has: {', '.join(compose['services'])})"
    return svc


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        out = {}
        for item in env:
            key, _, val = str(item).partition("=")
            out[key] = val
        return out
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _depends(svc: dict) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {k: (v or {}).get("condition", "service_started") for k, v in deps.items()}


def _build(svc: dict) -> tuple[Path, Path] | None:
    """(context, dockerfile) as absolute paths, or None without a build section."""
    b = svc.get("build")
    if b is None:
        return None
    if isinstance(b, str):
        b = {"context": b}
    context = (ROOT / b.get("context", ".")).resolve()
    return context, (context / b.get("dockerfile", "Dockerfile")).resolve()


DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
"""The one Dockerfile of every kiln image: a target per service folder, named after it."""


def _dockerfile(folder: str) -> Path:
    return DOCKERFILE


def _target(svc: dict) -> str | None:
    """The build target (stage) a compose service builds, or None."""
    b = svc.get("build")
    return b.get("target") if isinstance(b, dict) else None


def _healthcheck_argv(hc: dict) -> list[str]:
    test = hc.get("test")
    if isinstance(test, str):
        return shlex.split(test)
    test = list(test or [])
    if test and test[0] == "CMD-SHELL":
        return shlex.split(" ".join(test[1:]))
    if test and test[0] == "CMD":
        return test[1:]
    return test


def _volumes(svc: dict) -> list[dict]:
    """Each mount as ``{type, source, target, read_only}`` (short syntax parsed)."""
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out.append(
                {
                    "type": v.get("type", "volume"),
                    "source": v.get("source"),
                    "target": v.get("target"),
                    "read_only": bool(v.get("read_only")),
                }
            )
            continue
        parts = str(v).split(":")
        if len(parts) == 1:
            out.append({"type": "volume", "source": None, "target": parts[0], "read_only": False})
            continue
        src, target = parts[0], parts[1]
        mode = parts[2] if len(parts) > 2 else ""
        kind = "bind" if src.startswith((".", "/", "~")) else "volume"
        out.append({"type": kind, "source": src, "target": target, "read_only": "ro" in mode.split(",")})
    return out


def _host_path(svc: dict, container_path: str) -> Path | None:
    """The repository file a container path of ``svc`` shows, through its bind mounts."""
    p = PurePosixPath(container_path)
    for m in _volumes(svc):
        if m["type"] != "bind":
            continue
        target = PurePosixPath(m["target"])
        if p == target or target in p.parents:
            return (ROOT / m["source"] / p.relative_to(target)).resolve()
    return None


def _field_model(annotation) -> type[BaseModel] | None:
    """The settings model a field holds; for a discriminated union of models, one model
    whose fields are the union of its variants' (an env key may name any variant's)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    import typing

    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    variants = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    if not variants or len(variants) != len(typing.get_args(annotation)):
        return None
    fields = {k: f for v in variants for k, f in v.model_fields.items()}
    return type("AnyOf" + "".join(v.__name__ for v in variants), (), {"model_fields": fields, "__name__": "union"})


def _resolve_env_key(key: str, classes: list[type[ServiceConfig]]) -> str | None:
    """None if ``KILN_<SECTION>__<KEY>`` names a field of one of ``classes``, else why not."""
    if key == "KILN_CONFIG":
        return None
    body = key[len("KILN_") :]
    parts = body.lower().split("__")
    if len(parts) < 2 or not all(parts):
        return f"{key} is not of the form KILN_<SECTION>__<KEY>"
    section, rest = parts[0], parts[1:]
    owners = [cls for cls in classes if section in cls.model_fields]
    if not owners:
        known = sorted({f for cls in classes for f in cls.model_fields})
        return f"{key}: no settings class has a section {section!r} (sections: {', '.join(known)})"
    model = _field_model(owners[0].model_fields[section].annotation)
    if model is None:
        return f"{key}: {section!r} is not a settings section"
    path = section
    for i, name in enumerate(rest):
        if model is None:
            break  # below a dict field any key is data
        if name in getattr(model, "deprecated_keys", {}):
            return None  # an old flat key, still read (with a warning)
        if name not in model.model_fields:
            return f"{key}: section [{path}] ({model.__name__}) has no field {name!r} (fields: {', '.join(model.model_fields)})"
        f = model.model_fields[name]
        path = f"{path}.{name}"
        model = _field_model(f.annotation)
        if model is None and i < len(rest) - 1 and getattr(f.annotation, "__origin__", None) is not dict:
            return f"{key}: {path} is a plain value, it has no sub-keys"
    return None


def _kiln_env(svc: dict) -> dict[str, str]:
    return {k: v for k, v in _env(svc).items() if k.startswith("KILN_")}


# ------------------------------------------------------------------------------ tests
