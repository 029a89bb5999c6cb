"""A multi-step trial's reward in the job views (docs/SPEC.md §17).

`job_queue` gains `reward_strategy` (`mean` or `final`: a multi-step task's
`multi_step_reward_strategy`; null for a one-step task). `trial_rewards` (a view:
session_id, name, value) is each session's rewards as its trial's, were the trial to end
there: a one-step session's own; a step session's by its trial's strategy — `final` its
own, `mean` each name's mean over the step sessions of its attempt up to it that have a
result (a name a step lacks counting 0), as core/steps.py `trial_reward`. `job_trials`
and `job_reward_means` read a trial's rewards through it at `final_session_id` (the last
step session of the last attempt), so a multi-step trial counts once with its strategy's
reward — in `job_tasks` and `job_passk` too, which take a trial's `reward` from
`job_trials`; their figures per name (when rewards have several names) still read the
final session's own rows. `job_trials`' `attempts` counts attempts (a multi-step attempt is
several sessions), not sessions. The views over `job_trials` are rebuilt as revision 0014
left them otherwise.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-10
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

import sqlalchemy as sa
from alembic import op

from trialledger.migrations.columns import drop_columns

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def _revision(name: str) -> ModuleType:
    return importlib.import_module(f"trialledger.migrations.versions.{name}")


SUMMARY, WORK, NAMES, PRICES = (_revision("0010_job_summary"), _revision("0011_work_time"),
                                _revision("0013_reward_names"), _revision("0014_job_prices"))

TRIAL_REWARDS = """
CREATE VIEW trial_rewards AS
SELECT r.session_id, r.name, r.value
FROM rewards r
JOIN sessions s ON s.session_id = r.session_id
LEFT JOIN job_queue q ON q.trial_id = s.trial_id
WHERE s.step_index IS NULL OR q.reward_strategy = 'final'
UNION ALL
SELECT s.session_id, r.name,
  CAST(SUM(r.value) AS {float}) / (
    SELECT COUNT(*) FROM sessions u
    WHERE u.trial_id = s.trial_id AND u.attempt = s.attempt
      AND u.step_index <= s.step_index
      AND EXISTS (SELECT 1 FROM rewards x WHERE x.session_id = u.session_id)) AS value
FROM sessions s
LEFT JOIN job_queue q ON q.trial_id = s.trial_id
JOIN sessions t ON t.trial_id = s.trial_id AND t.attempt = s.attempt
  AND t.step_index <= s.step_index
JOIN rewards r ON r.session_id = t.session_id
WHERE s.step_index IS NOT NULL AND COALESCE(q.reward_strategy, 'mean') <> 'final'
GROUP BY s.session_id, s.trial_id, s.attempt, s.step_index, r.name
"""

_READ = re.compile(r"\brewards r\b")
_ATTEMPTS = ("(SELECT COUNT(*) FROM sessions s WHERE s.trial_id = q.trial_id) AS attempts")
assert PRICES.JOB_TRIALS.count(_ATTEMPTS) == 1


def through(view: str) -> str:
    """A view's reads of a trial's `rewards` made through `trial_rewards`."""
    return _READ.sub("trial_rewards r", view)


JOB_TRIALS = through(PRICES.JOB_TRIALS).replace(
    _ATTEMPTS, "(SELECT COUNT(DISTINCT s.attempt) FROM sessions s "
               "WHERE s.trial_id = q.trial_id) AS attempts")
# job_tasks and job_passk read a trial's `reward` from job_trials; their per-name figures
# (several reward names) still read its final session's own rows: through the view they
# took PostgreSQL 40 times longer to plan, past a lease holder's call deadline.
JOB_PASSK, JOB_TASKS = NAMES.JOB_PASSK, PRICES.JOB_TASKS
JOB_REWARD_MEANS = through(SUMMARY.JOB_REWARD_MEANS)
VIEWS = PRICES.VIEWS  # every view over job_trials, in the order they are built


def _rebuild(views: tuple[str, str, str, str]) -> None:
    dialect = op.get_bind().dialect.name
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    fill = {"wall": WORK.WALL[dialect], "float": SUMMARY.FLOAT[dialect]}
    for view in views:
        op.execute(view.format(**fill))


def upgrade() -> None:
    op.add_column("job_queue", sa.Column("reward_strategy", sa.Text))
    op.execute(TRIAL_REWARDS.format(float=SUMMARY.FLOAT[op.get_bind().dialect.name]))
    _rebuild((JOB_TRIALS, JOB_PASSK, JOB_TASKS, JOB_REWARD_MEANS))


def downgrade() -> None:
    _rebuild((PRICES.JOB_TRIALS, NAMES.JOB_PASSK, PRICES.JOB_TASKS, SUMMARY.JOB_REWARD_MEANS))
    op.execute("DROP VIEW trial_rewards")
    drop_columns("job_queue", ["reward_strategy"])
