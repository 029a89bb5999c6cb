"""Jobs (docs/SPEC.md §13): `jobs`, the `job_queue` of trials with their leases, and the
`job_trials` / `job_tasks` views.

The queue holds only what events cannot: which trials a job has, which one a worker holds
(lease token and expiry in the database's clock) and a task whose environment failed.
Every figure of the views is derived from the sessions of each trial (`sessions.trial_id`)
and their `outcomes` and `rewards`. pass@k is the unbiased estimator 1 − C(n−c, k)/C(n, k)
(n scored trials, c of them with reward ≥ 1, k the job's K), computed as a product by a
recursive query that SQLite and PostgreSQL both run; null when n < k.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

WALL = {
    "sqlite": "(julianday(s.closed_at) - julianday(s.created_at)) * 86400.0",
    "postgresql": "EXTRACT(EPOCH FROM (CAST(s.closed_at AS TIMESTAMPTZ) - "
                  "CAST(s.created_at AS TIMESTAMPTZ)))",
}

JOB_TRIALS = """
CREATE VIEW job_trials AS
SELECT q.job, q.trial_id, q.task, q.k_index, q.state,
  (SELECT COUNT(*) FROM sessions s WHERE s.trial_id = q.trial_id) AS attempts,
  f.session_id AS final_session_id,
  f.outcome AS outcome,
  (SELECT r.value FROM rewards r WHERE r.session_id = f.session_id
     ORDER BY CASE WHEN r.name = 'reward' THEN 0 ELSE 1 END, r.name LIMIT 1) AS reward,
  CASE WHEN f.outcome = 'verify' AND fo.reward_valid = 1 AND EXISTS (
     SELECT 1 FROM rewards r WHERE r.session_id = f.session_id) THEN 1 ELSE 0 END AS scored,
  (SELECT SUM(o.input_tokens) FROM sessions s JOIN outcomes o ON o.session_id = s.session_id
     WHERE s.trial_id = q.trial_id) AS input_tokens,
  (SELECT SUM(o.output_tokens) FROM sessions s JOIN outcomes o ON o.session_id = s.session_id
     WHERE s.trial_id = q.trial_id) AS output_tokens,
  (SELECT SUM(o.total_tokens) FROM sessions s JOIN outcomes o ON o.session_id = s.session_id
     WHERE s.trial_id = q.trial_id) AS total_tokens,
  (SELECT COUNT(*) FROM sessions s LEFT JOIN outcomes o ON o.session_id = s.session_id
     WHERE s.trial_id = q.trial_id AND o.total_tokens IS NULL) AS unknown_usage,
  (SELECT SUM({wall}) FROM sessions s
     WHERE s.trial_id = q.trial_id AND s.closed_at IS NOT NULL) AS wall_s
FROM job_queue q
LEFT JOIN sessions f ON f.session_id = (
  SELECT s.session_id FROM sessions s WHERE s.trial_id = q.trial_id
  ORDER BY s.attempt DESC, s.created_at DESC, s.session_id DESC LIMIT 1)
LEFT JOIN outcomes fo ON fo.session_id = f.session_id
"""

JOB_TASKS = """
CREATE VIEW job_tasks AS
WITH RECURSIVE counts AS (
  SELECT t.job, t.task, j.k AS k,
    COUNT(*) AS trials,
    SUM(t.scored) AS scored,
    SUM(CASE WHEN t.scored = 1 AND t.reward >= 1 THEN 1 ELSE 0 END) AS passed,
    AVG(CASE WHEN t.scored = 1 THEN t.reward END) AS mean_reward,
    SUM(CASE WHEN t.attempts > 1 THEN t.attempts - 1 ELSE 0 END) AS retries,
    SUM(t.total_tokens) AS total_tokens,
    SUM(t.unknown_usage) AS unknown_usage,
    SUM(t.wall_s) AS wall_s
  FROM job_trials t JOIN jobs j ON j.name = t.job
  GROUP BY t.job, t.task, j.k
),
terms (job, task, i, fail) AS (
  SELECT job, task, 0, CAST(1.0 AS DOUBLE PRECISION) FROM counts WHERE scored >= k
  UNION ALL
  SELECT terms.job, terms.task, terms.i + 1,
    terms.fail * (counts.scored - counts.passed - terms.i) / (counts.scored - terms.i)
  FROM terms JOIN counts ON counts.job = terms.job AND counts.task = terms.task
  WHERE terms.i < counts.k
)
SELECT c.job, c.task, c.trials, c.scored, c.mean_reward,
  (SELECT CASE WHEN MIN(terms.fail) < 0 THEN 1.0 ELSE 1.0 - MIN(terms.fail) END
     FROM terms WHERE terms.job = c.job AND terms.task = c.task AND terms.i = c.k)
     AS pass_at_k,
  c.retries, c.total_tokens, c.unknown_usage, c.wall_s
FROM counts c
"""


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("config", sa.Text, nullable=False),  # canonical JSON, no secrets
        sa.Column("k", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
    )
    op.create_table(
        "job_queue",
        sa.Column("trial_id", sa.Text, primary_key=True),
        sa.Column("job", sa.Text, sa.ForeignKey("jobs.name"), nullable=False),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("k_index", sa.Integer, nullable=False),
        sa.Column("task_dir", sa.Text, nullable=False),  # where this machine last saw it
        sa.Column("state", sa.Text, nullable=False),  # queued|running|done|environment_failed
        sa.Column("lease_token", sa.Text),
        sa.Column("lease_expires", sa.Float),  # the database's clock, seconds since epoch
        sa.Column("runner_id", sa.Text),
        sa.Column("detail", sa.Text),  # why environment_failed
    )
    op.create_index("job_queue_claim", "job_queue", ["job", "state", "task", "k_index"])
    dialect = op.get_bind().dialect.name
    op.execute(JOB_TRIALS.format(wall=WALL[dialect]))
    op.execute(JOB_TASKS if dialect == "postgresql"
               else JOB_TASKS.replace("DOUBLE PRECISION", "REAL"))


def downgrade() -> None:
    op.execute("DROP VIEW job_tasks")
    op.execute("DROP VIEW job_trials")
    op.drop_index("job_queue_claim", "job_queue")
    op.drop_table("job_queue")
    op.drop_table("jobs")
