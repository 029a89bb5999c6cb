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
    MIN(name) AS one_name
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

JOB_PASSK = f"""
CREATE VIEW job_passk AS
WITH RECURSIVE {OLD.COVER},
{BY_NAME},
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
  SELECT job, figure, COUNT(*) AS tasks, MIN(n) AS fewest, MIN(lo) AS name FROM members
  GROUP BY job, figure
  HAVING MIN(is_binary) = 1 AND (MIN(lo) IS NULL OR MIN(lo) = MAX(hi))
),
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
SELECT t.job, t.dataset, t.task, p.lo AS name, t.k, t.pass_at_k FROM task_pass t
JOIN per_task p ON p.job = t.job AND p.dataset = t.dataset AND p.task = t.task
UNION ALL
SELECT f.job, f.figure AS dataset, NULL AS task, f.name, tp.k, AVG(tp.pass_at_k) AS pass_at_k
FROM figures f
JOIN members m ON m.job = f.job AND COALESCE(m.figure, '') = COALESCE(f.figure, '')
JOIN task_pass tp ON tp.job = m.job AND tp.dataset = m.dataset AND tp.task = m.task
  AND tp.k <= f.fewest
GROUP BY f.job, f.figure, f.name, f.tasks, tp.k
HAVING COUNT(*) = f.tasks
UNION ALL
SELECT f.job, f.dataset, f.task, f.name, t.k, AVG(1 - t.fail) AS pass_at_k
FROM name_figures f
JOIN name_terms t ON t.job = f.job AND t.name = f.name AND t.i = t.k AND t.k <= f.fewest
  AND {SAME.format(a="t", b="f")}
GROUP BY f.job, f.dataset, f.task, f.name, f.tasks, t.k
HAVING COUNT(*) = f.tasks
"""

_FIGURE_COLUMNS = """f.trials, f.open, f.scored, f.finished - f.scored AS unscored"""
_COSTS = "f.retries, f.interrupted, f.total_tokens, f.unknown_usage, f.wall_s"
_AT_K = ("(SELECT p.pass_at_k FROM job_passk p JOIN jobs j ON j.name = p.job "
         "WHERE p.job = f.job AND p.k = j.k AND {same}{name})")

JOB_TASKS = f"""
CREATE VIEW job_tasks AS
WITH {OLD.COVER},
{BY_NAME},
totals AS (
  SELECT job, dataset, task, SUM(passed) AS passed,
    CAST(SUM(CASE WHEN scored = 1 THEN COALESCE(reward, 0) ELSE 0 END) AS {{float}}) AS total,
    CAST(SUM(retries) AS BIGINT) AS retries, CAST(SUM(interrupted) AS BIGINT) AS interrupted,
    CAST(SUM(total_tokens) AS BIGINT) AS total_tokens,
    CAST(SUM(unknown_usage) AS BIGINT) AS unknown_usage, SUM(wall_s) AS wall_s
  FROM cover GROUP BY job, dataset, task
),
named AS (
  SELECT job, dataset, task, name,
    SUM(CASE WHEN value >= 1 THEN 1 ELSE 0 END) AS passed,
    MIN(CASE WHEN value IS NULL OR value IN (0, 1) THEN 1 ELSE 0 END) AS is_binary,
    CAST(SUM(COALESCE(value, 0)) AS {{float}}) AS total
  FROM vals GROUP BY job, dataset, task, name
),
figure AS (
  SELECT g.job, g.dataset, g.task, g.trials, g.open, g.finished, g.scored, g.several,
    g.one_name, t.passed, t.total, t.retries, t.interrupted, t.total_tokens,
    t.unknown_usage, t.wall_s
  FROM fig g JOIN totals t ON t.job = g.job AND {SAME.format(a="t", b="g")}
)
SELECT f.job, f.dataset, f.task, f.one_name AS name, {_FIGURE_COLUMNS},
  f.passed,
  CASE WHEN f.finished > 0 THEN f.total / f.finished END AS mean,
  CASE WHEN f.scored > 0 THEN f.total / f.scored END AS mean_scored,
  {_COSTS},
  CASE WHEN f.scored > 0 THEN f.total / f.scored END AS mean_reward,
  {_AT_K.format(same=SAME.format(a="p", b="f"), name="")} AS pass_at_k
FROM figure f WHERE f.several = 0
UNION ALL
SELECT f.job, f.dataset, f.task, n.name, {_FIGURE_COLUMNS},
  CASE WHEN n.is_binary = 1 THEN n.passed END AS passed,
  CASE WHEN f.finished > 0 THEN n.total / f.finished END AS mean,
  CASE WHEN f.scored > 0 THEN n.total / f.scored END AS mean_scored,
  {_COSTS},
  CASE WHEN f.scored > 0 THEN n.total / f.scored END AS mean_reward,
  {_AT_K.format(same=SAME.format(a="p", b="f"), name=" AND p.name = n.name")} AS pass_at_k
FROM figure f JOIN named n ON n.job = f.job AND {SAME.format(a="n", b="f")}
WHERE f.several = 1
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
