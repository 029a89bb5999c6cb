"""Wall time of work only (docs/SPEC.md §13), and a job's skipped tasks (§15).

`wall_s` in `job_trials` (and so in `job_tasks`) was each closed session's seed-to-close
time: a session recovered after its runner died was charged the time the runner was dead
(73 s for 12.6 s of work). Now a session counts from its seed to its last event before the
gap in which no runner held it: for a session closed `recovered`, the last event stored
before the transaction that recovered it (that one appends `sandbox.lost`, a
`verification_interrupted` gap and `session.closed` together, long after); for every other
session (its own runner closed it), its close, as before. A session whose whole log was
stored at once (an import) keeps its close.

`job_skipped` (job, task, dataset, reason): the tasks of a job's datasets skipped as
invalid (a field this runner refuses, no `tests/test.sh`), listed by `job show`, in no
figure.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

import importlib
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# The moment a session's work ended: for a recovered session, its last event stored before
# the recovery's own transaction (every event of one commit shares its `recorded_at`).
WORK_END = """COALESCE(CASE WHEN s.close_reason = 'recovered' THEN (
  SELECT MAX(e.at) FROM events e WHERE e.session_id = s.session_id AND e.recorded_at < (
    SELECT c.recorded_at FROM events c WHERE c.session_id = s.session_id
    AND c.seq = s.head_seq)) END, s.closed_at)"""
WALL = {
    "sqlite": f"(julianday({WORK_END}) - julianday(s.created_at)) * 86400.0",
    "postgresql": f"CAST(EXTRACT(EPOCH FROM (CAST({WORK_END} AS TIMESTAMPTZ) - "
                  "CAST(s.created_at AS TIMESTAMPTZ))) AS DOUBLE PRECISION)",
}  # (a float on PostgreSQL too: EXTRACT gives a numeric, which JSON output shows as text)
# Every view built over job_trials, in the order they are built.
VIEWS = ("job_trials", "job_passk", "job_tasks", "job_reward_means")


def _summary_0010() -> ModuleType:
    """Revision 0010, whose view definitions are rebuilt here with another `wall`."""
    return importlib.import_module("trialledger.migrations.versions.0010_job_summary")


def _rebuild_views(wall: str) -> None:
    dialect = op.get_bind().dialect.name
    old = _summary_0010()
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    fill = {"wall": wall, "float": old.FLOAT[dialect]}
    for view in (old.JOB_TRIALS, old.JOB_PASSK, old.JOB_TASKS, old.JOB_REWARD_MEANS):
        op.execute(view.format(**fill))


def upgrade() -> None:
    _rebuild_views(WALL[op.get_bind().dialect.name])
    op.create_table(
        "job_skipped",
        sa.Column("job", sa.Text, sa.ForeignKey("jobs.name"), nullable=False),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("dataset", sa.Text),
        sa.Column("reason", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("job", "task"),
    )


def downgrade() -> None:
    op.drop_table("job_skipped")
    _rebuild_views(_summary_0010().WALL[op.get_bind().dialect.name])
