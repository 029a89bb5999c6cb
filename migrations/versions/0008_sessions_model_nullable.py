"""`sessions.model` may be null: an oracle or nop session asks no model (docs/SPEC.md §15).

PostgreSQL drops the constraint in place. SQLite cannot drop a NOT NULL constraint, so the
table is rebuilt (alembic's batch copy, indexes kept); `legacy_alter_table` lets the copy
be renamed back to `sessions` while the views that read it (`decisions`, `job_trials`)
still name it, as SQLite's documented table-rebuild procedure does.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def _model_nullable(nullable: bool) -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("sessions", "model", existing_type=sa.Text, nullable=nullable)
        return
    op.execute("PRAGMA legacy_alter_table = ON")
    with op.batch_alter_table("sessions", recreate="always") as batch:
        batch.alter_column("model", existing_type=sa.Text, nullable=nullable)
    op.execute("PRAGMA legacy_alter_table = OFF")


def upgrade() -> None:
    _model_nullable(True)


def downgrade() -> None:
    op.execute("UPDATE sessions SET model = '' WHERE model IS NULL")
    _model_nullable(False)
