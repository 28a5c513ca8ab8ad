"""Database models: runs, policy versions, task groups, trajectory records, learner
steps and evaluations.

Who writes what (one writer per column family, so services never race on a row):
- the controller (learner process) inserts ``runs`` and ``task_groups`` and sets a
  group's terminal ``status`` (``trained`` or ``dropped`` with a ``reason``);
- the weights service inserts ``policy_versions``;
- reward inserts ``trajectories``; the learner sets ``trained_version`` on the ones a
  step consumed;
- the learner inserts one ``steps`` row per optimizer step (the ``StepMetrics`` it
  publishes), ``kiln eval`` (or the run's periodic evaluation) inserts ``evaluations``.
Every string column is ``SafeString``/``SafeText`` and every JSON column ``SafeJSON``
(``types.py``): any text a workspace produced (NUL bytes, lone surrogates, deep nesting)
is stored, cleaned at the one place values are bound, never refused. A group ends exactly once: ``status`` moves from ``dispatched`` to ``trained`` or
``dropped`` and never back (``kiln.learner.controller`` enforces it with a
conditional update).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Boolean, DateTime, Float, ForeignKey, Index, Integer
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kiln.shared.db.types import SafeJSON, SafeString, SafeText


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(SafeString(64), primary_key=True)
    name: Mapped[str] = mapped_column(SafeString(200))
    status: Mapped[str] = mapped_column(SafeString(16), default="running")
    """running | finished | failed"""
    config: Mapped[dict] = mapped_column(SafeJSON, default=dict)
    detail: Mapped[str] = mapped_column(SafeText, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class PolicyVersion(Base):
    __tablename__ = "policy_versions"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer)
    parent_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    path: Mapped[str] = mapped_column(SafeText)
    manifest_sha256: Mapped[str] = mapped_column(SafeString(64))
    num_bytes: Mapped[int] = mapped_column(Integer, default=0)
    """Bytes of the version's files (what a full copy ships)."""
    stored_bytes: Mapped[int] = mapped_column(Integer, default=0)
    """Bytes the store holds for it (a delta version: its compressed delta)."""
    storage: Mapped[str] = mapped_column(SafeString(8), default="full")
    """full | delta"""
    base_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tags: Mapped[list] = mapped_column(SafeJSON, default=list)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    """Pinned and tagged versions are never deleted by retention."""
    published_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class TaskGroup(Base):
    __tablename__ = "task_groups"

    group_id: Mapped[str] = mapped_column(SafeString(128), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    task_id: Mapped[str] = mapped_column(SafeString(200))
    n_samples: Mapped[int] = mapped_column(Integer)
    dispatch_version: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(SafeString(16), default="dispatched")
    """dispatched | trained | dropped"""
    reason: Mapped[str | None] = mapped_column(SafeString(32), nullable=True)
    detail: Mapped[str] = mapped_column(SafeText, default="")
    trained_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The version produced by the step that trained this group."""
    deadline: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    dispatched_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (Index("ix_task_groups_run_status", "run_id", "status"),)


class TrajectoryRecord(Base):
    __tablename__ = "trajectories"

    trajectory_id: Mapped[str] = mapped_column(SafeString(160), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    group_id: Mapped[str] = mapped_column(SafeString(128), index=True)
    task_id: Mapped[str] = mapped_column(SafeString(200))
    sample_index: Mapped[int] = mapped_column(Integer)
    dispatch_version: Mapped[int] = mapped_column(Integer)
    min_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Oldest policy version among the generated tokens (None: no generated tokens)."""
    max_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    passed: Mapped[bool] = mapped_column(Boolean, default=False)
    infra_error: Mapped[str | None] = mapped_column(SafeText, nullable=True)
    num_tokens: Mapped[int] = mapped_column(Integer, default=0)
    num_generated: Mapped[int] = mapped_column(Integer, default=0)
    num_turns: Mapped[int] = mapped_column(Integer, default=0)
    malformed_tool_calls: Mapped[int] = mapped_column(Integer, default=0)
    finish_reason: Mapped[str] = mapped_column(SafeString(32), default="")
    tests: Mapped[dict] = mapped_column(SafeJSON, default=dict)
    reward_terms: Mapped[dict] = mapped_column(SafeJSON, default=dict)
    """Each term of the reward (the tests' score, shaping terms); ``reward`` is their sum."""
    test_output: Mapped[str] = mapped_column(SafeText, default="")
    """The test run's output, cut to ``reward.max_test_output_chars``; the whole log is in
    the ``kiln-reward-logs`` object store under ``log_key``."""
    log_key: Mapped[str] = mapped_column(SafeString(200), default="")
    failure: Mapped[str | None] = mapped_column(SafeString(32), nullable=True)
    """Why it did not pass (``contracts.Failure``; None: passed or infra error)."""
    failure_detail: Mapped[str] = mapped_column(SafeText, default="")
    touched_protected: Mapped[bool] = mapped_column(Boolean, default=False)
    """Its diff changed protected paths (reverted before the tests ran)."""
    tampered: Mapped[bool] = mapped_column(Boolean, default=False)
    """The tested code replaced test-framework entry points."""
    integrity: Mapped[dict] = mapped_column(SafeJSON, default=dict)
    """``contracts.Integrity``: protected paths touched and why, tampering, changes not reproduced."""
    report: Mapped[dict | None] = mapped_column(SafeJSON, nullable=True)
    """kiln's runner's structured report (``kiln.shared.tasks.testrun.RunnerReport``)."""
    messages: Mapped[list] = mapped_column(SafeJSON, default=list)
    trace_id: Mapped[str] = mapped_column(SafeString(32), default="")
    worker_id: Mapped[str] = mapped_column(SafeString(128), default="")
    trained_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    purpose: Mapped[str] = mapped_column(SafeString(8), default="train")
    """``train`` or ``eval`` (an evaluation episode, never trained)."""
    eval_id: Mapped[str] = mapped_column(SafeString(160), default="")
    scored_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class StepRecord(Base):
    """One learner step, as published on ``kiln.learner.metrics``; the dashboard's curves."""

    __tablename__ = "steps"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    trajectories: Mapped[int] = mapped_column(Integer)
    mean_reward: Mapped[float] = mapped_column(Float)
    pass_rate: Mapped[float] = mapped_column(Float)
    loss: Mapped[float] = mapped_column(Float)
    mean_staleness: Mapped[float] = mapped_column(Float)
    max_staleness: Mapped[int] = mapped_column(Integer)
    step_seconds: Mapped[float] = mapped_column(Float)
    wait_seconds: Mapped[float] = mapped_column(Float)
    elapsed_seconds: Mapped[float] = mapped_column(Float)
    metrics: Mapped[dict] = mapped_column(SafeJSON, default=dict)
    """The whole ``StepMetrics`` message (fields not promoted to columns included)."""
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class EvalRecord(Base):
    """One evaluation of one policy version on a held-out split: greedy pass rate and
    pass@k (unbiased estimator over ``samples`` draws per task at a fixed seed)."""

    __tablename__ = "evaluations"
    __table_args__ = (Index("ix_evaluations_run_version", "run_id", "version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    suite: Mapped[str] = mapped_column(SafeString(200))
    split: Mapped[str] = mapped_column(SafeString(32))
    tasks: Mapped[int] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(Integer)
    """Sampled episodes per task (pass@k needs samples >= k); 0 when only greedy ran."""
    seed: Mapped[int] = mapped_column(Integer)
    greedy_pass_rate: Mapped[float] = mapped_column(Float)
    pass_at_k: Mapped[dict] = mapped_column(SafeJSON, default=dict)
    """``{"1": 0.4, "4": 0.7}``."""
    per_task: Mapped[dict] = mapped_column(SafeJSON, default=dict)
    """task id -> ``{"greedy": bool, "passed": n, "samples": n}``."""
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
