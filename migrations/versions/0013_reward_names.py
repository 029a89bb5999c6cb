"""Figures per reward name (docs/SPEC.md §13): `job_tasks` and `job_passk` gain `name`.

A figure whose scored trials carry several reward names between them had its headline
blanked (mean, mean_scored, passed and pass@k null, a mean per name in `job_reward_means`
only). Now such a figure has one `job_tasks` row per name, carrying that name's `mean`
(over the finished trials), `mean_scored` (over the scored ones) — a trial without the name
counting 0 — and, for a name whose values are all 0 or 1, `passed` and `pass_at_k`; its
counts (trials, open, scored, retries, tokens, wall time) are the figure's, repeated on
each name's row. `job_passk` has one row per figure, name and k: for a name of such a
figure, Harbor's estimator over that name (a task's c = its trials valued 1), averaged over
the tasks an overall figure covers. A figure with at most one name keeps its one row and
its figures as before, `name` being that name (null when no scored trial names one).

`job_tasks` is one SELECT, each figure LEFT JOINed to its several names: as a UNION of the
one-name and the several-name rows, SQLite computed the figures' cover (all of
`job_trials`) once per branch — 3× the time of revision 0010's view on 1,000 trials; so
it is as fast as 0010's. `job_passk` keeps 0010's query for one-name figures as it was.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

from __future__ import annotations

import importlib
from types import ModuleType

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def _summary_0010() -> ModuleType:
    """Revision 0010, whose `cover` of figures this revision's views share."""
    return importlib.import_module("trialledger.migrations.versions.0010_job_summary")


OLD = _summary_0010()
SAME = OLD.SAME_FIGURE
# A figure's several reward names, and each finished trial it covers valued for each name
# (a scored trial without the name 0, an unscored one null): a task figure covers its own
# trials, a dataset's figure its dataset's, the job's total all of them; `m_dataset` and
# `m_task` are the trial's own task (a member, for pass@k over tasks).
BY_NAME = f"""
fig AS (
  SELECT job, dataset, task, COUNT(*) AS trials, SUM(1 - finished) AS open,
    SUM(finished) AS finished, SUM(scored) AS scored, {OLD.SEVERAL} AS several,
    MIN(name) AS one_name, SUM(passed) AS passed,
    CAST(SUM(CASE WHEN scored = 1 THEN COALESCE(reward, 0) ELSE 0 END) AS {{float}})
      AS total,
    CAST(SUM(retries) AS BIGINT) AS retries, CAST(SUM(interrupted) AS BIGINT) AS interrupted,
    CAST(SUM(total_tokens) AS BIGINT) AS total_tokens,
    CAST(SUM(unknown_usage) AS BIGINT) AS unknown_usage, SUM(wall_s) AS wall_s
  FROM cover GROUP BY job, dataset, task
),
fig_names AS (
  SELECT DISTINCT f.job, f.dataset, f.task, r.name
  FROM fig f
  JOIN cover c ON c.job = f.job AND c.scored = 1 AND {SAME.format(a="c", b="f")}
  JOIN rewards r ON r.session_id = c.final_session_id
  WHERE f.several = 1
),
vals AS (
  SELECT fn.job, fn.dataset, fn.task, fn.name, x.dataset AS m_dataset, x.task AS m_task,
    x.finished, x.scored,
    CASE WHEN x.scored = 1 THEN COALESCE((SELECT r.value FROM rewards r
      WHERE r.session_id = x.final_session_id AND r.name = fn.name), 0) END AS value
  FROM fig_names fn JOIN fin x ON x.job = fn.job
    AND (fn.task IS NULL OR fn.task = x.task) AND (fn.dataset IS NULL OR fn.dataset = x.dataset)
),
member AS (
  SELECT job, dataset, task, name, m_dataset, m_task, SUM(finished) AS n,
    SUM(CASE WHEN value >= 1 THEN 1 ELSE 0 END) AS c,
    MIN(CASE WHEN value IS NULL OR value IN (0, 1) THEN 1 ELSE 0 END) AS is_binary
  FROM vals GROUP BY job, dataset, task, name, m_dataset, m_task
)"""

# Revision 0010's pass@k of one-name figures, as it was (its CTEs, then its query), each
# row given its figure's one name; then a row per name of each figure with several.
_ONE_NAME_CTES = OLD.JOB_PASSK[OLD.JOB_PASSK.index("per_task AS ("):
                               OLD.JOB_PASSK.index("\nSELECT job, dataset, task, k, pass_at_k")]
_ONE_NAME_ROWS = OLD.JOB_PASSK[OLD.JOB_PASSK.index("SELECT job, dataset, task, k, pass_at_k"):]

JOB_PASSK = f"""
CREATE VIEW job_passk AS
WITH RECURSIVE {OLD.COVER},
{BY_NAME},
{_ONE_NAME_CTES},
one_name AS ({_ONE_NAME_ROWS}),
name_terms (job, dataset, task, name, m_dataset, m_task, n, c, k, i, fail) AS (
  SELECT m.job, m.dataset, m.task, m.name, m.m_dataset, m.m_task, m.n, m.c, s.k, 0,
    CAST(1.0 AS {{float}})
  FROM member m JOIN kset s ON s.k <= m.n WHERE m.is_binary = 1
  UNION ALL
  SELECT job, dataset, task, name, m_dataset, m_task, n, c, k, i + 1,
    fail * (n - c - i) / (n - i)
  FROM name_terms WHERE i < k
),
name_figures AS (
  SELECT job, dataset, task, name, COUNT(*) AS tasks, MIN(n) AS fewest FROM member
  WHERE n > 0 GROUP BY job, dataset, task, name HAVING MIN(is_binary) = 1
)
SELECT o.job, o.dataset, o.task, g.one_name AS name, o.k, o.pass_at_k FROM one_name o
JOIN fig g ON g.job = o.job AND {SAME.format(a="g", b="o")}
UNION ALL
SELECT f.job, f.dataset, f.task, f.name, t.k, AVG(1 - t.fail) AS pass_at_k
FROM name_figures f
JOIN name_terms t ON t.job = f.job AND t.name = f.name AND t.i = t.k AND t.k <= f.fewest
  AND {SAME.format(a="t", b="f")}
GROUP BY f.job, f.dataset, f.task, f.name, f.tasks, t.k
HAVING COUNT(*) = f.tasks
"""

# One row per figure, joined to its names when it has several (else none: its one row).
JOB_TASKS = f"""
CREATE VIEW job_tasks AS
WITH {OLD.COVER},
{BY_NAME},
named AS (
  SELECT job, dataset, task, name,
    SUM(CASE WHEN value >= 1 THEN 1 ELSE 0 END) AS passed,
    MIN(CASE WHEN value IS NULL OR value IN (0, 1) THEN 1 ELSE 0 END) AS is_binary,
    CAST(SUM(COALESCE(value, 0)) AS {{float}}) AS total
  FROM vals GROUP BY job, dataset, task, name
)
SELECT f.job, f.dataset, f.task, COALESCE(n.name, f.one_name) AS name, f.trials, f.open,
  f.scored, f.finished - f.scored AS unscored,
  CASE WHEN n.name IS NULL THEN f.passed WHEN n.is_binary = 1 THEN n.passed END AS passed,
  CASE WHEN f.finished > 0 THEN COALESCE(n.total, f.total) / f.finished END AS mean,
  CASE WHEN f.scored > 0 THEN COALESCE(n.total, f.total) / f.scored END AS mean_scored,
  f.retries, f.interrupted, f.total_tokens, f.unknown_usage, f.wall_s,
  CASE WHEN f.scored > 0 THEN COALESCE(n.total, f.total) / f.scored END AS mean_reward,
  (SELECT p.pass_at_k FROM job_passk p JOIN jobs j ON j.name = p.job
     WHERE p.job = f.job AND p.k = j.k AND {SAME.format(a="p", b="f")}
     AND (n.name IS NULL OR p.name = n.name)) AS pass_at_k
FROM fig f LEFT JOIN named n ON n.job = f.job AND {SAME.format(a="n", b="f")}
"""

VIEWS = ("job_passk", "job_tasks")  # in the order they are built (job_tasks reads job_passk)


def _rebuild(views: tuple[str, str]) -> None:
    fill = {"float": OLD.FLOAT[op.get_bind().dialect.name]}
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    for view in views:
        op.execute(view.format(**fill))


def upgrade() -> None:
    _rebuild((JOB_PASSK, JOB_TASKS))


def downgrade() -> None:
    _rebuild((OLD.JOB_PASSK, OLD.JOB_TASKS))
