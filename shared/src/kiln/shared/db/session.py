"""Engines, sessions and migrations.

URLs are accepted in their plain form (``postgresql://``, ``sqlite:///``) and mapped to
the async driver for services (psycopg 3, aiosqlite) and the sync driver for Alembic.
Schema changes only happen through Alembic migrations (``kiln db upgrade``, run once by
``kiln run`` or the compose ``migrate`` job before services start).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

MIGRATIONS = Path(__file__).parent / "migrations"


def async_url(url: str) -> str:
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres", "postgresql+psycopg2", "postgresql+psycopg"):
        u = u.set(drivername="postgresql+psycopg")
    elif u.drivername in ("sqlite", "sqlite+pysqlite"):
        u = u.set(drivername="sqlite+aiosqlite")
    return u.render_as_string(hide_password=False)


def sync_url(url: str) -> str:
    u = make_url(url)
    if u.drivername.startswith("postgres"):
        u = u.set(drivername="postgresql+psycopg")
    elif u.drivername.startswith("sqlite"):
        u = u.set(drivername="sqlite")
    return u.render_as_string(hide_password=False)


class Database:
    def __init__(self, url: str, echo: bool = False):
        if not url:
            raise ValueError(
                "database.url is empty: set KILN_DATABASE__URL (postgresql://... or sqlite:///...) "
                "or start the platform with `kiln run`, which starts an embedded database"
            )
        self.url = url
        kwargs: dict = {"echo": echo}
        if make_url(url).drivername.startswith("sqlite"):
            kwargs["connect_args"] = {"timeout": 30}
        else:
            kwargs.update(pool_pre_ping=True, pool_size=5, max_overflow=5)
        self.engine: AsyncEngine = create_async_engine(async_url(url), **kwargs)
        if make_url(url).drivername.startswith("sqlite"):
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A transaction: commits on success, rolls back on error."""
        async with self.sessions() as s:
            async with s.begin():
                yield s

    async def close(self) -> None:
        await self.engine.dispose()


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    # Several service processes share one file: WAL lets readers and one writer overlap.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", sync_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (synchronous; call before services start)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)
