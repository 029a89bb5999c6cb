"""`runners`: each runner's heartbeat, in the database's clock (SPEC §10 `recover`).

A runner beats while it runs sessions; `recover` refuses (without `--force`) to close the
sessions of a runner whose heartbeat is fresh, so a live run is never closed under it.
`heartbeat` is seconds since the epoch as the database server counts them, so runners
on machines with skewed clocks compare alike.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runners",
        sa.Column("runner_id", sa.Text, primary_key=True),
        sa.Column("heartbeat", sa.Float, nullable=False),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("runners")
