"""`model_calls` (SPEC §14) and the environment of each session (SPEC §12).

`model_calls` is a projection table, one row per `model.call` event, kept by the writer
like `tool_calls`; `completed` is INTEGER 0/1. `sessions` gains `environment_ref` and
`environment_digest` from a schema-2 `agent.launched` (null for the host environment and
for every session recorded before). No earlier database holds a `model.call` event or a
schema-2 launch, so nothing needs filling.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from trialledger.migrations.columns import drop_columns

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

TEXT, INT = sa.Text, sa.Integer


def upgrade() -> None:
    op.create_table(
        "model_calls",
        sa.Column("session_id", TEXT, nullable=False),
        sa.Column("call", INT, nullable=False),
        sa.Column("method", TEXT, nullable=False),
        sa.Column("path", TEXT, nullable=False),
        sa.Column("started_at", TEXT, nullable=False),
        sa.Column("ended_at", TEXT),
        sa.Column("http_status", INT),
        sa.Column("error", TEXT),
        sa.Column("completed", INT, nullable=False),
        sa.Column("model", TEXT),
        sa.Column("total_tokens", INT),
        sa.PrimaryKeyConstraint("session_id", "call"),
    )
    # Plain ADD COLUMN (a batch rebuild of `sessions` would break the views that read it).
    op.add_column("sessions", sa.Column("environment_ref", TEXT))
    op.add_column("sessions", sa.Column("environment_digest", TEXT))


def downgrade() -> None:
    drop_columns("sessions", ("environment_digest", "environment_ref"))
    op.drop_table("model_calls")
