"""Database access: async SQLAlchemy over PostgreSQL (psycopg 3) or SQLite (aiosqlite)."""

from kiln.shared.db.models import Base, EvalRecord, PolicyVersion, Run, StepRecord, TaskGroup, TrajectoryRecord
from kiln.shared.db.session import Database, async_url, sync_url, upgrade

__all__ = [
    "Base",
    "Database",
    "EvalRecord",
    "PolicyVersion",
    "Run",
    "StepRecord",
    "TaskGroup",
    "TrajectoryRecord",
    "async_url",
    "sync_url",
    "upgrade",
]
