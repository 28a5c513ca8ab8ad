"""Shared fixtures: a real nats-server per test, one real PostgreSQL server per session
(a fresh, migrated database per test), and experiment files for in-process services."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from kiln.ops.embedded import NatsServer, PostgresServer
from kiln.shared.bus import Bus
from kiln.shared.config import NatsSettings
from kiln.shared.db import upgrade

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEEP = 200
"""Folders this deep in the temporary directories are removed by ``rm`` at the session's
end: the attack and walk tests make trees 1,500 levels deep, and pytest's own clean-up
of old temporary directories (``shutil.rmtree``, recursive) fails the whole session on them
with a RecursionError (exit 1)."""


def pytest_sessionfinish(session):
    import subprocess

    root = Path(tempfile.gettempdir()) / f"pytest-of-{os.environ.get('USER') or __import__('getpass').getuser()}"
    base = getattr(session.config, "_tmp_path_factory", None)
    if base is not None and base._basetemp is not None:
        root = base._basetemp.parent if base._basetemp.name.startswith("pytest-") else base._basetemp
    if root.is_dir():
        subprocess.run(
            [
                "find",
                str(root),
                "-mindepth",
                str(DEEP),
                "-maxdepth",
                str(DEEP),
                "-type",
                "d",
                "-prune",
                "-exec",
                "rm",
                "-rf",
                "{}",
                "+",
            ],
            check=False,
            capture_output=True,
        )


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server):
    b = await Bus.connect(NatsSettings(url=nats_server.url), "test")
    await b.ensure_topology()
    yield b
    await b.close()


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server (``scripts/setup.sh`` installs it; CI runs that first).
    Its folder is directly under /tmp: as root the server runs as ``postgres``, which
    cannot enter pytest's private temp tree."""
    base = Path(tempfile.mkdtemp(prefix="kiln-test-pg-"))
    server = PostgresServer(base).start()
    yield server
    server.stop()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(postgres):
    """A fresh database at the latest migration."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:{postgres.port}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql://postgres@127.0.0.1:{postgres.port}/{name}"
    upgrade(url)
    return url


def write_experiment(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture
async def envpool(nats_server, bus, run_dir):
    """A real env-pool service (in-process) and a client for it."""
    from harness import InProcessPlatform, experiment

    from kiln.shared.envpool_client import EnvPoolClient

    p = InProcessPlatform(experiment(run_dir, nats_server.url, "sqlite://"))
    await p.start("env-pool")
    yield EnvPoolClient(bus)
    await p.stop_all()
