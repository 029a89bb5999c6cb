"""`outcomes` becomes a projection table (one row per decided session), not a view.

The view found each session's last decision with a correlated subquery and a join on
every read, which grew slow with the number of sessions. As a table kept by the writer it
is a plain scan. Its columns (and the `decisions` view) are unchanged; existing
rows are filled from `decision_log` and `sessions`.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TEXT, INT = sa.Text, sa.Integer
COLUMNS = """session_id, policy, rule, action, outcome, status, http_status, error, cause_kind,
    cause_message, status_code, incomplete_reason, reward_valid, input_tokens,
    cached_input_tokens, output_tokens, reasoning_output_tokens, total_tokens, decided_at"""
LAST_DECISIONS = """
    SELECT d.session_id, d.policy, d.rule, d.action, s.outcome, d.status, d.http_status,
        d.error, d.cause_kind, d.cause_message, d.status_code, d.incomplete_reason,
        d.reward_valid, d.input_tokens, d.cached_input_tokens, d.output_tokens,
        d.reasoning_output_tokens, d.total_tokens, d.decided_at
    FROM decision_log d JOIN sessions s ON s.session_id = d.session_id
    WHERE d.seq = (SELECT max(l.seq) FROM decision_log l WHERE l.session_id = d.session_id)"""


def upgrade() -> None:
    op.execute("DROP VIEW outcomes")
    op.create_table(
        "outcomes",
        sa.Column("session_id", TEXT, primary_key=True),
        sa.Column("policy", TEXT, nullable=False),
        sa.Column("rule", TEXT, nullable=False),
        sa.Column("action", TEXT, nullable=False),
        sa.Column("outcome", TEXT, nullable=False),
        sa.Column("status", TEXT, nullable=False),
        sa.Column("http_status", INT),
        sa.Column("error", TEXT),
        sa.Column("cause_kind", TEXT),
        sa.Column("cause_message", TEXT),
        sa.Column("status_code", INT),
        sa.Column("incomplete_reason", TEXT),
        sa.Column("reward_valid", sa.Boolean, nullable=False),
        sa.Column("input_tokens", INT),
        sa.Column("cached_input_tokens", INT),
        sa.Column("output_tokens", INT),
        sa.Column("reasoning_output_tokens", INT),
        sa.Column("total_tokens", INT),
        sa.Column("decided_at", TEXT, nullable=False),
    )
    op.create_index("outcomes_cause", "outcomes", ["cause_kind", "action"])
    op.execute(f"INSERT INTO outcomes ({COLUMNS}) {LAST_DECISIONS}")


def downgrade() -> None:
    op.drop_index("outcomes_cause", "outcomes")
    op.drop_table("outcomes")
    op.execute(f"CREATE VIEW outcomes AS {LAST_DECISIONS}")
