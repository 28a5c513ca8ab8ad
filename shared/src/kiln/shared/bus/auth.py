"""Credentials per service and subject permissions for kiln's NATS (an authenticated bus).

``permissions(service)`` says what a service's credential may not publish; everything a
service needs (its own streams, JetStream's API, request inboxes) stays allowed:

- only the learner publishes checkpoints (``kiln.weights.checkpoint``) and dispatches
  work (``kiln.rollout.work``, ``kiln.eval.work``, rollout control);
- only rollout and reward drive sandboxes (``kiln.envpool.>``, env-pool answering);
- only weights announces versions (``kiln.weights.published.>``);
- the launcher's own credential (``kiln run``) may do everything; a client without a
  credential cannot connect at all.

``server_config`` writes the ``authorization`` block of a nats-server configuration with
one user per service and a random password each (``Credentials``); ``kiln run`` starts
its embedded nats-server with it and hands each service process its own credential
(``KILN_NATS__USER`` / ``KILN_NATS__PASSWORD``). ``write_secrets`` writes the same as
files for a deployment (``kiln bus credentials``: compose secrets, read by each service
through ``nats.password_file``).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from kiln.shared import contracts as c

LEARNER_ONLY = [c.WEIGHTS_CHECKPOINT, c.ROLLOUT_WORK, c.ROLLOUT_CONTROL, c.EVAL_WORK]
SANDBOX_DRIVERS = ("rollout", "reward", "env-pool")
ADMIN = "launcher"


def denied(service: str) -> list[str]:
    """Subjects ``service`` may not publish to."""
    if service == ADMIN:
        return []
    deny = [] if service == "learner" else list(LEARNER_ONLY)
    if service not in SANDBOX_DRIVERS:
        deny += ["kiln.envpool.>"]
    if service != "weights":
        deny += ["kiln.weights.published.>"]
    return deny


@dataclass(frozen=True)
class Credentials:
    users: dict[str, str]
    """Service name -> its password."""

    @classmethod
    def generate(cls, services: list[str]) -> Credentials:
        return cls({name: secrets.token_urlsafe(24) for name in [ADMIN, *services]})


def server_config(creds: Credentials) -> str:
    """The nats-server configuration's ``authorization`` block (JSON is valid NATS config)."""
    users = []
    for name, password in creds.users.items():
        user: dict = {"user": name, "password": password}
        if deny := denied(name):
            user["permissions"] = {"publish": {"deny": deny}}
        users.append(user)
    return "authorization " + json.dumps({"users": users}, indent=1) + "\n"


SECRET_SERVICES = ("env-pool", "weights", "reward", "rollout", "learner")
"""Services that get a credential in a deployment (compose); ``launcher`` is the operator's."""


def write_secrets(out: Path, services: tuple[str, ...] = SECRET_SERVICES) -> list[Path]:
    """Credentials as files for compose secrets: ``nats-<service>.password`` for each
    service and the operator (``launcher``), and ``nats-auth.conf`` (the servers'
    ``authorization`` block, included by ``deploy/nats/*.conf``).

    ``out`` is made mode 700, so no other host user reaches them; the files themselves are
    0644 because compose bind-mounts a secret with its host permissions and the services
    run as an unprivileged user (uid 10001) that must read its own. Each container mounts
    only its own password.

    Idempotent: passwords already in ``out`` are kept (a deployment keeps working), only
    missing ones are generated; the server block is rewritten from them."""
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    fresh = Credentials.generate(list(services))
    users = {}
    for name, generated in fresh.users.items():
        f = out / f"nats-{name}.password"
        users[name] = f.read_text().strip() if f.is_file() else generated
    written = [_secret(out / f"nats-{name}.password", pw + "\n") for name, pw in users.items()]
    written.append(_secret(out / "nats-auth.conf", server_config(Credentials(users))))
    return written


def _secret(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o644)  # readable by the container's user; the folder (700) keeps the host's out
    return path
