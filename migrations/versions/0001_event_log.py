"""The event log, its projections and the analyst views (SPEC §2, §10).

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TEXT, INT, BOOL = sa.Text, sa.Integer, sa.Boolean

# The columns of the `outcomes` and `decisions` views, in SPEC §10 order.
DECISION_COLUMNS = """d.session_id, d.policy, d.rule, d.action, s.outcome, d.status, d.http_status,
    d.error, d.cause_kind, d.cause_message, d.status_code, d.incomplete_reason, d.reward_valid,
    d.input_tokens, d.cached_input_tokens, d.output_tokens, d.reasoning_output_tokens,
    d.total_tokens, d.decided_at"""


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                  primary_key=True, autoincrement=True),
        sa.Column("session_id", TEXT, nullable=False),
        sa.Column("seq", INT, nullable=False),
        sa.Column("event_id", TEXT, nullable=False),
        sa.Column("type", TEXT, nullable=False),
        sa.Column("at", TEXT, nullable=False),
        sa.Column("recorded_at", TEXT, nullable=False),
        sa.Column("schema", INT, nullable=False),
        sa.Column("data", TEXT, nullable=False),  # the canonical text (SPEC §2), never JSONB
        sa.Column("hash", TEXT, nullable=False),
        sa.UniqueConstraint("session_id", "seq", name="events_session_seq"),
        sa.UniqueConstraint("event_id", name="events_event_id"),
        sqlite_autoincrement=True,
    )
    op.create_index("events_type", "events", ["type"])
    op.create_table(
        "sessions",
        sa.Column("session_id", TEXT, primary_key=True),
        sa.Column("trial_id", TEXT, nullable=False),
        sa.Column("attempt", INT, nullable=False),
        sa.Column("retry_of", TEXT),
        sa.Column("task", TEXT, nullable=False),
        sa.Column("agent_name", TEXT, nullable=False),
        sa.Column("agent_version", TEXT, nullable=False),
        sa.Column("model", TEXT, nullable=False),
        sa.Column("runner_id", TEXT, nullable=False),
        sa.Column("state", TEXT, nullable=False),
        sa.Column("outcome", TEXT, nullable=False),
        sa.Column("close_reason", TEXT),
        sa.Column("created_at", TEXT, nullable=False),
        sa.Column("closed_at", TEXT),
        sa.Column("head_seq", INT, nullable=False),
        sa.Column("head_hash", TEXT, nullable=False),
    )
    op.create_index("sessions_trial", "sessions", ["trial_id", "attempt"])
    op.create_index("sessions_task", "sessions", ["task"])
    op.create_index("sessions_runner_state", "sessions", ["runner_id", "state"])
    op.create_table(
        "decision_log",
        sa.Column("session_id", TEXT, nullable=False),
        sa.Column("seq", INT, nullable=False),
        sa.Column("policy", TEXT, nullable=False),
        sa.Column("rule", TEXT, nullable=False),
        sa.Column("action", TEXT, nullable=False),
        sa.Column("status", TEXT, nullable=False),
        sa.Column("http_status", INT),
        sa.Column("error", TEXT),
        sa.Column("cause_kind", TEXT),
        sa.Column("cause_message", TEXT),
        sa.Column("status_code", INT),
        sa.Column("incomplete_reason", TEXT),
        sa.Column("reward_valid", BOOL, nullable=False),
        sa.Column("input_tokens", INT),
        sa.Column("cached_input_tokens", INT),
        sa.Column("output_tokens", INT),
        sa.Column("reasoning_output_tokens", INT),
        sa.Column("total_tokens", INT),
        sa.Column("decided_at", TEXT, nullable=False),
        sa.PrimaryKeyConstraint("session_id", "seq"),
    )
    op.create_table(
        "tool_calls",
        sa.Column("session_id", TEXT, nullable=False),
        sa.Column("item_id", TEXT, nullable=False),
        sa.Column("name", TEXT, nullable=False),
        sa.Column("kind", TEXT, nullable=False),
        sa.Column("status", TEXT, nullable=False),
        sa.Column("started_at", TEXT),
        sa.Column("completed_at", TEXT),
        sa.PrimaryKeyConstraint("session_id", "item_id"),
    )
    op.create_table(
        "gaps",
        sa.Column("session_id", TEXT, nullable=False),
        sa.Column("code", TEXT, nullable=False),
        sa.Column("detail", TEXT),
    )
    op.create_index("gaps_session", "gaps", ["session_id"])
    op.create_index("gaps_code", "gaps", ["code"])
    op.create_table(
        "rewards",
        sa.Column("session_id", TEXT, nullable=False),
        sa.Column("name", TEXT, nullable=False),
        sa.Column("value", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("session_id", "name"),
    )
    op.execute(f"""CREATE VIEW decisions AS
        SELECT {DECISION_COLUMNS}, d.seq
        FROM decision_log d JOIN sessions s ON s.session_id = d.session_id""")
    op.execute(f"""CREATE VIEW outcomes AS
        SELECT {DECISION_COLUMNS}
        FROM decision_log d JOIN sessions s ON s.session_id = d.session_id
        WHERE d.seq = (SELECT max(l.seq) FROM decision_log l WHERE l.session_id = d.session_id)""")


def downgrade() -> None:
    op.execute("DROP VIEW outcomes")
    op.execute("DROP VIEW decisions")
    for table in ("rewards", "gaps", "tool_calls", "decision_log", "sessions", "events"):
        op.drop_table(table)
