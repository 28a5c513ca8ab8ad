"""Serving the dashboard: for a live run (``kiln run`` starts it beside the services)
or afterwards (``kiln dashboard runs/<run-id>``, which restarts the run's embedded
PostgreSQL on its own data folder when that is where the run wrote)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kiln.shared.config import load_toml
from kiln.shared.db import Database
from kiln.shared.http import serve_http


def database_of_run(run_dir: Path):
    """The database URL a finished run wrote to, and the embedded server started for it (or None)."""
    cfg = run_dir / "config.toml"
    if not cfg.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.toml)")
    url = load_toml(cfg).get("database", {}).get("url", "")
    if url.startswith("sqlite"):
        return url, None
    if (run_dir / "db" / "pg").is_dir():
        from kiln.ops.embedded import PostgresServer

        pg = PostgresServer(run_dir / "db" / "pg").start()
        return pg.url, pg
    if url:
        return url, None
    raise ValueError(f"{cfg} names no database")


async def serve_dashboard(
    db_url: str,
    host: str,
    port: int,
    token: str,
    stop: asyncio.Event,
    *,
    traces_dir: Path | None = None,
    title: str = "kiln",
) -> tuple[str, asyncio.Task]:
    from kiln.ops.dashboard.app import create_app

    db = Database(db_url)
    url, task = await serve_http(
        create_app(db, token=token, title=title, traces_dir=traces_dir), host, port, token, stop
    )

    async def close_after() -> None:
        try:
            await task
        finally:
            await db.close()

    return url, asyncio.create_task(close_after())


def run_dashboard(target: str | None, db_url: str | None, host: str, port: int, token: str) -> int:
    pg, traces = None, None
    if target is not None:
        traces = Path(target).resolve() / "traces"
    if db_url is None:
        if target is None:
            raise SystemExit("kiln dashboard: give a run folder (runs/<run-id>) or --db URL")
        db_url, pg = database_of_run(Path(target).resolve())

    async def main() -> None:
        stop = asyncio.Event()
        from kiln.shared.service import StopSignals  # never lost under load, unlike loop.add_signal_handler

        signals = StopSignals(asyncio.get_running_loop(), lambda _sig: stop.set()).install()
        try:
            url, task = await serve_dashboard(db_url, host, port, token, stop, traces_dir=traces)
            print(f"dashboard: {url}/  (Ctrl-C stops it)", flush=True)
            await task
        finally:
            signals.close()

    try:
        asyncio.run(main())
    finally:
        if pg:
            pg.stop()
    return 0
