"""weights storage, tags and pins; reward terms and log keys

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 17:06:37.486632
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # server defaults let existing rows take the new NOT NULL columns
    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("stored_bytes", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("storage", sa.String(length=8), nullable=False, server_default="full"))
        batch_op.add_column(sa.Column("base_version", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("tags", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("pinned", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))

    with op.batch_alter_table("trajectories", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reward_terms", sa.JSON(), nullable=False, server_default="{}"))
        batch_op.add_column(sa.Column("log_key", sa.String(length=200), nullable=False, server_default=""))


def downgrade() -> None:
    # server defaults let existing rows take the new NOT NULL columns
    with op.batch_alter_table("trajectories", schema=None) as batch_op:
        batch_op.drop_column("log_key")
        batch_op.drop_column("reward_terms")

    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.drop_column("deleted_at")
        batch_op.drop_column("pinned")
        batch_op.drop_column("tags")
        batch_op.drop_column("base_version")
        batch_op.drop_column("storage")
        batch_op.drop_column("stored_bytes")
