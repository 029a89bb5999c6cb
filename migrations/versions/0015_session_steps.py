"""The step of a multi-step task each session ran (docs/SPEC.md §17).

`sessions` gains `step_name`, `step_index` (1-based) and `step_count` from the `step` of a
schema-2 `session.seeded` (store/projections.py fills them); null for a one-step task's
session and for every session recorded before. No earlier database holds a schema-2 seed,
so nothing needs filling.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from trialledger.migrations.columns import drop_columns

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

COLUMNS = (("step_name", sa.Text), ("step_index", sa.Integer), ("step_count", sa.Integer))


def upgrade() -> None:
    # Plain ADD COLUMN (a batch rebuild of `sessions` would break the views that read it).
    for name, kind in COLUMNS:
        op.add_column("sessions", sa.Column(name, kind))


def downgrade() -> None:
    drop_columns("sessions", [name for name, _ in reversed(COLUMNS)])
