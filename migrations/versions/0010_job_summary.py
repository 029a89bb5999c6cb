"""The job summary as Harbor computes it (docs/SPEC.md §13, §10): `job_queue.dataset`,
`job_trials` with `passed` and `interrupted`, `job_tasks` with finished/open trials, the
means and overall rows, and the new `job_passk`, `job_reward_means` and `job_retries`.

Every figure is over **finished** trials (neither queued nor running); `trials` and `open`
count them all. A figure covers a task's trials (a task row), a dataset's (task null; only
when the job has several datasets) or the job's (dataset and task null): the `cover` CTE
lists each trial once per figure it is in, so every view groups one way. pass@k is the
product 1 − Π (n−c−i)/(n−i) computed by a recursive CTE, for k in Harbor's set (powers of
two from 2, multiples of 5) up to the task's finished trials; an overall figure averages its
tasks' values for each k up to its fewest finished trials. `pass_at_k` of `job_tasks` (kept,
deprecated) is pass@K for the job's K. The same SQL runs on SQLite and PostgreSQL (sums of
counts cast to BIGINT: PostgreSQL's SUM of a bigint is numeric).

A cancelled session has no decision, so no `outcomes` row: its usage is the proxy's (the
sum of its 2xx `POST …/responses` calls) when the proxy recorded calls and every such call
completed with usage, as policy v3 counts it; else unknown. wall_s is still each closed
session's seed-to-close time (a session recovered after its runner died is charged the
dead time: the store keeps no record of when a lease lapsed).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

from trialledger.migrations.columns import drop_columns

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

WALL = {
    "sqlite": "(julianday(s.closed_at) - julianday(s.created_at)) * 86400.0",
    "postgresql": "EXTRACT(EPOCH FROM (CAST(s.closed_at AS TIMESTAMPTZ) - "
                  "CAST(s.created_at AS TIMESTAMPTZ)))",
}
FLOAT = {"sqlite": "REAL", "postgresql": "DOUBLE PRECISION"}
BILLED = ("m.session_id = s.session_id AND m.http_status >= 200 AND m.http_status < 300 "
          "AND UPPER(m.method) = 'POST' AND m.path LIKE '%/responses%'")
INTERRUPTED = "COALESCE(s.close_reason, '') IN ('cancelled', 'recovered')"

# A session's known total: its decision's, else (cancelled) the proxy's when complete.
SESSION_TOKENS = f"""CASE WHEN o.session_id IS NOT NULL THEN o.total_tokens
      WHEN EXISTS (SELECT 1 FROM model_calls m WHERE m.session_id = s.session_id)
       AND NOT EXISTS (SELECT 1 FROM model_calls m WHERE {BILLED}
                       AND (m.completed = 0 OR m.total_tokens IS NULL))
      THEN (SELECT COALESCE(SUM(m.total_tokens), 0) FROM model_calls m WHERE {BILLED}) END"""

JOB_TRIALS = f"""
CREATE VIEW job_trials AS
SELECT q.job, q.trial_id, q.task, q.k_index, q.state,
  (SELECT COUNT(*) FROM sessions s WHERE s.trial_id = q.trial_id) AS attempts,
  f.session_id AS final_session_id,
  f.outcome AS outcome,
  CASE WHEN rw.names = 1 THEN rw.value
       WHEN rw.names IS NULL AND f.outcome = 'verify' AND fo.reward_valid = 1 THEN 0.0
  END AS reward,
  CASE WHEN f.outcome = 'verify' AND fo.reward_valid = 1 THEN 1 ELSE 0 END AS scored,
  (SELECT CAST(SUM(o.input_tokens) AS BIGINT) FROM sessions s
     JOIN outcomes o ON o.session_id = s.session_id WHERE s.trial_id = q.trial_id)
     AS input_tokens,
  (SELECT CAST(SUM(o.output_tokens) AS BIGINT) FROM sessions s
     JOIN outcomes o ON o.session_id = s.session_id WHERE s.trial_id = q.trial_id)
     AS output_tokens,
  (SELECT CAST(SUM({SESSION_TOKENS}) AS BIGINT) FROM sessions s
     LEFT JOIN outcomes o ON o.session_id = s.session_id WHERE s.trial_id = q.trial_id)
     AS total_tokens,
  (SELECT COUNT(*) FROM sessions s LEFT JOIN outcomes o ON o.session_id = s.session_id
     WHERE s.trial_id = q.trial_id AND ({SESSION_TOKENS}) IS NULL) AS unknown_usage,
  (SELECT SUM({{wall}}) FROM sessions s
     WHERE s.trial_id = q.trial_id AND s.closed_at IS NOT NULL) AS wall_s,
  CASE WHEN rw.names > 1 THEN NULL
       WHEN f.outcome = 'verify' AND fo.reward_valid = 1 AND rw.names = 1 AND rw.value >= 1
       THEN 1 ELSE 0 END AS passed,
  (SELECT COUNT(*) FROM sessions s WHERE s.trial_id = q.trial_id AND {INTERRUPTED})
     AS interrupted
FROM job_queue q
LEFT JOIN sessions f ON f.session_id = (
  SELECT s.session_id FROM sessions s WHERE s.trial_id = q.trial_id
  ORDER BY s.attempt DESC, s.created_at DESC, s.session_id DESC LIMIT 1)
LEFT JOIN outcomes fo ON fo.session_id = f.session_id
LEFT JOIN (SELECT r.session_id, COUNT(*) AS names, MAX(r.value) AS value FROM rewards r
           GROUP BY r.session_id) rw ON rw.session_id = f.session_id
"""

# Each trial once per figure it is in; open trials are in (for `trials` and `open`) with
# every other column zero or null. `names`/`name`: the scored trial's reward names.
COVER = f"""
trial AS (
  SELECT t.job, COALESCE(q.dataset, 'adhoc') AS dataset, t.task, t.final_session_id,
    CASE WHEN t.state IN ('queued', 'running') THEN 0 ELSE 1 END AS finished,
    t.scored, t.reward, t.passed, t.interrupted, t.total_tokens, t.unknown_usage, t.wall_s,
    (SELECT COUNT(*) FROM rewards r WHERE r.session_id = t.final_session_id) AS names,
    (SELECT MIN(r.name) FROM rewards r WHERE r.session_id = t.final_session_id) AS name,
    (SELECT COUNT(*) FROM sessions s JOIN outcomes o ON o.session_id = s.session_id
       WHERE s.trial_id = t.trial_id AND o.action = 'retry' AND NOT {INTERRUPTED})
       AS retries
  FROM job_trials t JOIN job_queue q ON q.trial_id = t.trial_id
),
fin AS (
  SELECT job, dataset, task, final_session_id, finished,
    scored * finished AS scored,
    CASE WHEN finished = 1 AND scored = 1 THEN reward END AS reward,
    CASE WHEN finished = 1 AND scored = 1 THEN passed ELSE 0 END AS passed,
    CASE WHEN finished = 1 AND scored = 1 THEN names ELSE 0 END AS names,
    CASE WHEN finished = 1 AND scored = 1 AND names = 1 THEN name END AS name,
    retries * finished AS retries, interrupted * finished AS interrupted,
    CASE WHEN finished = 1 THEN total_tokens END AS total_tokens,
    unknown_usage * finished AS unknown_usage,
    CASE WHEN finished = 1 THEN wall_s END AS wall_s
  FROM trial
),
several_datasets AS (
  SELECT job FROM fin GROUP BY job HAVING COUNT(DISTINCT dataset) > 1
),
cover AS (
  SELECT * FROM fin
  UNION ALL
  SELECT job, dataset, NULL, final_session_id, finished, scored, reward, passed, names, name,
    retries, interrupted, total_tokens, unknown_usage, wall_s
  FROM fin WHERE job IN (SELECT job FROM several_datasets)
  UNION ALL
  SELECT job, NULL, NULL, final_session_id, finished, scored, reward, passed, names, name,
    retries, interrupted, total_tokens, unknown_usage, wall_s
  FROM fin
)"""

SAME_FIGURE = ("COALESCE({a}.dataset, '') = COALESCE({b}.dataset, '') "
               "AND COALESCE({a}.task, '') = COALESCE({b}.task, '')")
SEVERAL = "CASE WHEN MAX(names) > 1 OR COUNT(DISTINCT name) > 1 THEN 1 ELSE 0 END"

JOB_PASSK = f"""
CREATE VIEW job_passk AS
WITH RECURSIVE {COVER},
per_task AS (
  SELECT job, dataset, task, SUM(finished) AS n, SUM(passed) AS c,
    MIN(CASE WHEN scored = 0 OR (names = 1 AND reward IN (0, 1)) THEN 1 ELSE 0 END)
      AS is_binary,
    MIN(name) AS lo, MAX(name) AS hi
  FROM fin GROUP BY job, dataset, task
),
ks (k) AS (
  SELECT 1 UNION ALL SELECT k + 1 FROM ks WHERE k < (SELECT MAX(n) FROM per_task)
),
kset AS (SELECT k FROM ks WHERE k % 5 = 0 OR (k > 1 AND (k & (k - 1)) = 0)),
terms (job, dataset, task, n, c, k, i, fail) AS (
  SELECT p.job, p.dataset, p.task, p.n, p.c, s.k, 0, CAST(1.0 AS {{float}})
  FROM per_task p JOIN kset s ON s.k <= p.n
  WHERE p.is_binary = 1 AND (p.lo IS NULL OR p.lo = p.hi)
  UNION ALL
  SELECT job, dataset, task, n, c, k, i + 1, fail * (n - c - i) / (n - i)
  FROM terms WHERE i < k
),
task_pass AS (
  SELECT job, dataset, task, k, 1 - fail AS pass_at_k FROM terms WHERE i = k
),
members AS (
  SELECT job, dataset AS figure, dataset, task, n, is_binary, lo, hi FROM per_task
  WHERE n > 0 AND job IN (SELECT job FROM several_datasets)
  UNION ALL
  SELECT job, NULL, dataset, task, n, is_binary, lo, hi FROM per_task WHERE n > 0
),
figures AS (
  SELECT job, figure, COUNT(*) AS tasks, MIN(n) AS fewest FROM members
  GROUP BY job, figure
  HAVING MIN(is_binary) = 1 AND (MIN(lo) IS NULL OR MIN(lo) = MAX(hi))
)
SELECT job, dataset, task, k, pass_at_k FROM task_pass
UNION ALL
SELECT f.job, f.figure AS dataset, NULL AS task, tp.k, AVG(tp.pass_at_k) AS pass_at_k
FROM figures f
JOIN members m ON m.job = f.job AND COALESCE(m.figure, '') = COALESCE(f.figure, '')
JOIN task_pass tp ON tp.job = m.job AND tp.dataset = m.dataset AND tp.task = m.task
  AND tp.k <= f.fewest
GROUP BY f.job, f.figure, f.tasks, tp.k
HAVING COUNT(*) = f.tasks
"""

JOB_TASKS = f"""
CREATE VIEW job_tasks AS
WITH {COVER},
fig AS (
  SELECT job, dataset, task, COUNT(*) AS trials, SUM(1 - finished) AS open,
    SUM(finished) AS finished, SUM(scored) AS scored, SUM(passed) AS passed,
    {SEVERAL} AS several,
    CAST(SUM(CASE WHEN scored = 1 THEN COALESCE(reward, 0) ELSE 0 END) AS {{float}}) AS total,
    CAST(SUM(retries) AS BIGINT) AS retries, CAST(SUM(interrupted) AS BIGINT) AS interrupted,
    CAST(SUM(total_tokens) AS BIGINT) AS total_tokens,
    CAST(SUM(unknown_usage) AS BIGINT) AS unknown_usage, SUM(wall_s) AS wall_s
  FROM cover GROUP BY job, dataset, task
)
SELECT f.job, f.dataset, f.task, f.trials, f.open, f.scored, f.finished - f.scored AS unscored,
  CASE WHEN f.several = 0 THEN f.passed END AS passed,
  CASE WHEN f.several = 0 AND f.finished > 0 THEN f.total / f.finished END AS mean,
  CASE WHEN f.several = 0 AND f.scored > 0 THEN f.total / f.scored END AS mean_scored,
  f.retries, f.interrupted, f.total_tokens, f.unknown_usage, f.wall_s,
  CASE WHEN f.several = 0 AND f.scored > 0 THEN f.total / f.scored END AS mean_reward,
  (SELECT p.pass_at_k FROM job_passk p JOIN jobs j ON j.name = p.job
     WHERE p.job = f.job AND p.k = j.k AND {SAME_FIGURE.format(a="p", b="f")}) AS pass_at_k
FROM fig f
"""

JOB_REWARD_MEANS = f"""
CREATE VIEW job_reward_means AS
WITH {COVER},
fig AS (
  SELECT job, dataset, task, SUM(finished) AS finished, {SEVERAL} AS several
  FROM cover GROUP BY job, dataset, task
)
SELECT f.job, f.dataset, f.task, r.name, CAST(SUM(r.value) AS {{float}}) / f.finished AS mean
FROM fig f
JOIN cover c ON c.job = f.job AND c.scored = 1 AND {SAME_FIGURE.format(a="c", b="f")}
JOIN rewards r ON r.session_id = c.final_session_id
WHERE f.several = 1
GROUP BY f.job, f.dataset, f.task, f.finished, r.name
"""

JOB_RETRIES = f"""
CREATE VIEW job_retries AS
SELECT q.job, q.task, COALESCE(o.cause_kind, o.rule) AS cause_kind, COUNT(*) AS sessions
FROM job_queue q
JOIN sessions s ON s.trial_id = q.trial_id
JOIN outcomes o ON o.session_id = s.session_id
WHERE o.action = 'retry' AND NOT {INTERRUPTED} AND q.state NOT IN ('queued', 'running')
GROUP BY q.job, q.task, COALESCE(o.cause_kind, o.rule)
"""

NEW_VIEWS = ("job_retries", "job_reward_means", "job_tasks", "job_passk", "job_trials")


def _jobs_0006() -> ModuleType:
    """Revision 0006, whose views a downgrade restores."""
    path = Path(__file__).with_name("0006_jobs.py")
    spec = importlib.util.spec_from_file_location("trialledger_migration_0006", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW job_tasks")
    op.execute("DROP VIEW job_trials")
    op.add_column("job_queue", sa.Column("dataset", sa.Text))  # null: from before; `adhoc`
    fill = {"wall": WALL[dialect], "float": FLOAT[dialect]}
    for view in (JOB_TRIALS, JOB_PASSK, JOB_TASKS, JOB_REWARD_MEANS, JOB_RETRIES):
        op.execute(view.format(**fill))


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    for name in NEW_VIEWS:
        op.execute(f"DROP VIEW {name}")
    drop_columns("job_queue", ["dataset"])
    old = _jobs_0006()
    op.execute(old.JOB_TRIALS.format(wall=old.WALL[dialect]))
    op.execute(old.JOB_TASKS if dialect == "postgresql"
               else old.JOB_TASKS.replace("DOUBLE PRECISION", "REAL"))
