"""A job's price table and what its sessions cost (docs/SPEC.md §18).

`job_prices` (job, model, input, cached_input, output, reasoning: USD per million tokens):
one row per model a job's `job run --prices FILE` priced. Kept out of the job's
configuration (`jobs.config`), so a resume with another table is never refused: the last
table given replaces the job's rows.

`session_costs` (a view: session_id, job, trial_id, task, agent_name, model, cost_usd):
each session of a job's trials priced by its job's table, by the formula of `core/cost.py`
— ((input − cached)·input + cached·cached_input + (output − reasoning)·output +
reasoning·reasoning) / 10⁶, cached being part of the input and reasoning part of the
output. 0 for the oracle and nop agents; null (never 0) when the session has no decision
(so no usage), its model is not in the table, or a part the prices tell apart was not
reported. Costs are computed, never stored: a new table reprices every session.

`job_trials` gains `cost_usd` (its sessions' sum) and `job_tasks` `cost_usd` (its figure's
trials' sum); each null when one it sums is. The views over `job_trials` are rebuilt as
revision 0013 left them.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-08
"""

from __future__ import annotations

import importlib
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None



def _revision(name: str) -> ModuleType:
    return importlib.import_module(f"trialledger.migrations.versions.{name}")


SUMMARY, WORK, NAMES = (_revision("0010_job_summary"), _revision("0011_work_time"),
                        _revision("0013_reward_names"))

SESSION_COSTS = """
CREATE VIEW session_costs AS
SELECT s.session_id, q.job, s.trial_id, s.task, s.agent_name, s.model,
  CASE WHEN s.agent_name IN ('oracle', 'nop') THEN 0.0
       WHEN o.input_tokens IS NULL OR o.output_tokens IS NULL OR p.model IS NULL THEN NULL
       WHEN o.cached_input_tokens IS NULL AND p.cached_input <> p.input THEN NULL
       WHEN o.reasoning_output_tokens IS NULL AND p.reasoning <> p.output THEN NULL
       ELSE ((o.input_tokens - COALESCE(o.cached_input_tokens, 0)) * p.input
             + COALESCE(o.cached_input_tokens, 0) * p.cached_input
             + (o.output_tokens - COALESCE(o.reasoning_output_tokens, 0)) * p.output
             + COALESCE(o.reasoning_output_tokens, 0) * p.reasoning) / 1000000.0
  END AS cost_usd
FROM sessions s
JOIN job_queue q ON q.trial_id = s.trial_id
LEFT JOIN outcomes o ON o.session_id = s.session_id
LEFT JOIN job_prices p ON p.job = q.job AND p.model = s.model
"""


def _sum_of_known(rows: str) -> str:
    """The sum of `cost_usd` over `rows` (a FROM … WHERE …), null when one is null."""
    return (f"(SELECT CASE WHEN COUNT(*) > COUNT(c.cost_usd) THEN NULL "
            f"ELSE COALESCE(SUM(c.cost_usd), 0.0) END FROM {rows})")


_TRIALS_FROM = "\nFROM job_queue q\nLEFT JOIN sessions f ON"
_TASKS_FROM = "\nFROM fig f LEFT JOIN named n ON"
assert SUMMARY.JOB_TRIALS.count(_TRIALS_FROM) == 1 and NAMES.JOB_TASKS.count(_TASKS_FROM) == 1
JOB_TRIALS = SUMMARY.JOB_TRIALS.replace(_TRIALS_FROM, f""",
  {_sum_of_known("session_costs c WHERE c.trial_id = q.trial_id")} AS cost_usd{_TRIALS_FROM}""")
JOB_TASKS = NAMES.JOB_TASKS.replace(_TASKS_FROM, f""",
  {_sum_of_known("job_trials c JOIN job_queue cq ON cq.trial_id = c.trial_id "
                 "WHERE c.job = f.job AND (f.task IS NULL OR c.task = f.task) "
                 "AND (f.dataset IS NULL OR COALESCE(cq.dataset, 'adhoc') = f.dataset)")
   } AS cost_usd{_TASKS_FROM}""")
# Every view over job_trials, in the order they are built.
VIEWS = ("job_trials", "job_passk", "job_tasks", "job_reward_means")


def _rebuild(job_trials: str, job_tasks: str) -> None:
    dialect = op.get_bind().dialect.name
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    fill = {"wall": WORK.WALL[dialect], "float": SUMMARY.FLOAT[dialect]}
    for view in (job_trials, NAMES.JOB_PASSK, job_tasks, SUMMARY.JOB_REWARD_MEANS):
        op.execute(view.format(**fill))


def upgrade() -> None:
    op.create_table(
        "job_prices",
        sa.Column("job", sa.Text, sa.ForeignKey("jobs.name"), nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("input", sa.Float, nullable=False),
        sa.Column("cached_input", sa.Float, nullable=False),
        sa.Column("output", sa.Float, nullable=False),
        sa.Column("reasoning", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("job", "model"),
    )
    op.execute(SESSION_COSTS)
    _rebuild(JOB_TRIALS, JOB_TASKS)


def downgrade() -> None:
    _rebuild(SUMMARY.JOB_TRIALS, NAMES.JOB_TASKS)
    op.execute("DROP VIEW session_costs")
    op.drop_table("job_prices")
