"""Flags are INTEGER 0/1 in every view on every database (SPEC §10).

On PostgreSQL `reward_valid` was BOOLEAN, so `SUM(reward_valid)` and `reward_valid = 1`
failed there while they worked on SQLite (which stores booleans as 0/1 already). The
columns of `decision_log` and `outcomes` become INTEGER; the `decisions` view, which
reads `decision_log`, is rebuilt around the change. SQLite needs nothing.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

DECISIONS = """CREATE VIEW decisions AS
    SELECT d.session_id, d.policy, d.rule, d.action, s.outcome, d.status, d.http_status,
        d.error, d.cause_kind, d.cause_message, d.status_code, d.incomplete_reason,
        d.reward_valid, d.input_tokens, d.cached_input_tokens, d.output_tokens,
        d.reasoning_output_tokens, d.total_tokens, d.decided_at, d.seq
    FROM decision_log d JOIN sessions s ON s.session_id = d.session_id"""


def _retype(to: str, using: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP VIEW decisions")
    for table in ("decision_log", "outcomes"):
        op.execute(f"ALTER TABLE {table} ALTER COLUMN reward_valid TYPE {to} "
                   f"USING {using}")
    op.execute(DECISIONS)


def upgrade() -> None:
    _retype("INTEGER", "reward_valid::integer")


def downgrade() -> None:
    _retype("BOOLEAN", "reward_valid <> 0")
