"""learner steps and evaluations; trajectory purpose

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 06:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "steps",
        sa.Column("run_id", sa.String(length=64), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("step", sa.Integer(), primary_key=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("trajectories", sa.Integer(), nullable=False),
        sa.Column("mean_reward", sa.Float(), nullable=False),
        sa.Column("pass_rate", sa.Float(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        sa.Column("mean_staleness", sa.Float(), nullable=False),
        sa.Column("max_staleness", sa.Integer(), nullable=False),
        sa.Column("step_seconds", sa.Float(), nullable=False),
        sa.Column("wait_seconds", sa.Float(), nullable=False),
        sa.Column("elapsed_seconds", sa.Float(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(length=64), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("suite", sa.String(length=200), nullable=False),
        sa.Column("split", sa.String(length=32), nullable=False),
        sa.Column("tasks", sa.Integer(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("greedy_pass_rate", sa.Float(), nullable=False),
        sa.Column("pass_at_k", sa.JSON(), nullable=False),
        sa.Column("per_task", sa.JSON(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_evaluations_run_version", "evaluations", ["run_id", "version"])
    with op.batch_alter_table("trajectories", schema=None) as batch_op:
        batch_op.add_column(sa.Column("purpose", sa.String(length=8), nullable=False, server_default="train"))
        batch_op.add_column(sa.Column("eval_id", sa.String(length=160), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("trajectories", schema=None) as batch_op:
        batch_op.drop_column("eval_id")
        batch_op.drop_column("purpose")
    op.drop_index("ix_evaluations_run_version", table_name="evaluations")
    op.drop_table("evaluations")
    op.drop_table("steps")
