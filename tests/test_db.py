"""Database: the migrations produce exactly the models' schema, on a real PostgreSQL
server and on SQLite, and the exactly-once end of a group holds under the database."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, update

from kiln.shared.db import Base, Database, Run, TaskGroup, sync_url, upgrade


def _diff(url: str):
    engine = create_engine(sync_url(url))
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    return diff


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request, tmp_path):
    if request.param == "postgres":
        return request.getfixturevalue("pg_url")
    url = f"sqlite:///{tmp_path / 'k.db'}"
    upgrade(url)
    return url


def test_migrations_match_models(db_url):
    assert _diff(db_url) == []
    upgrade(db_url)  # idempotent at head


async def test_group_ends_exactly_once(db_url):
    db = Database(db_url)
    try:
        async with db.session() as s:
            s.add(Run(id="r", name="n", config={"a": 1}))
        async with db.session() as s:
            s.add(
                TaskGroup(
                    group_id="g",
                    run_id="r",
                    task_id="t",
                    n_samples=2,
                    dispatch_version=0,
                    deadline=datetime.now(UTC),
                )
            )

        async def end(status):
            async with db.session() as s:
                res = await s.execute(
                    update(TaskGroup)
                    .where(TaskGroup.group_id == "g", TaskGroup.status == "dispatched")
                    .values(status=status)
                )
                return res.rowcount

        assert await end("trained") == 1
        assert await end("dropped") == 0  # a second end is refused by the conditional update
        async with db.session() as s:
            g = await s.get(TaskGroup, "g")
            assert g.status == "trained" and (await s.get(Run, "r")).config == {"a": 1}
    finally:
        await db.close()


def test_empty_url_is_a_clear_error():
    with pytest.raises(ValueError, match="database.url is empty"):
        Database("")
