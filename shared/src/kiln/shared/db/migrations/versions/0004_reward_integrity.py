"""reward integrity: failure reason, integrity findings and the runner's report per trajectory

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07 05:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # server defaults let existing rows take the new NOT NULL columns
    with op.batch_alter_table("trajectories", schema=None) as batch_op:
        batch_op.add_column(sa.Column("failure", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("failure_detail", sa.Text(), nullable=False, server_default=""))
        batch_op.add_column(sa.Column("touched_protected", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column("tampered", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column("integrity", sa.JSON(), nullable=False, server_default="{}"))
        batch_op.add_column(sa.Column("report", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trajectories", schema=None) as batch_op:
        for name in ("report", "integrity", "tampered", "touched_protected", "failure_detail", "failure"):
            batch_op.drop_column(name)
