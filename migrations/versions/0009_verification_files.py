"""`verification_files`: one row per file a verification kept (docs/SPEC.md §15).

A projection table kept by the writer, as `rewards` is: one row per entry of a schema-3
`verification.*` event's `files` (its path in the session's artifact folder, its size
and sha256). No earlier database holds a schema-3 verification, so nothing needs filling.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "verification_files",
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("sha256", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("session_id", "path"),
    )


def downgrade() -> None:
    op.drop_table("verification_files")
