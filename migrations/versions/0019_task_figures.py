"""`job_tasks` without its two costly columns, for the summary (docs/sql.md).

SQLite plans a view whole, whatever columns a query asks of it. `job_tasks` computes two
columns by subqueries over other views: `pass_at_k` (over `job_passk`) and `cost_usd`
(over `job_trials` again). Planning them was nearly all of its cost: 0.24 s for the
summary's read on a fresh connection, against 0.014 s without them. That is paid on
every `job run` and `job show`, and the summary reads `pass_at_k` from `job_passk`
and computes costs itself anyway.

`job_task_figures` is `job_tasks` without those two columns and with one more, `named`:
the reward name of a figure with several names (null for a figure of one name, whose
`name` is then its only name). `job_tasks` is now those figures with the two columns
added, its columns, their order and their values unchanged.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

from __future__ import annotations

import importlib
from types import ModuleType

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def _revision(name: str) -> ModuleType:
    return importlib.import_module(f"trialledger.migrations.versions.{name}")


SUMMARY, WORK, NAMES = (_revision("0010_job_summary"), _revision("0011_work_time"),
                        _revision("0017_trial_reward_names"))

# job_tasks' two costly columns, as revision 0017 wrote them (its final select's last two)
_TEXT = NAMES.JOB_TASKS
_HEAD = "CREATE VIEW job_tasks AS\n"
_AT = _TEXT.index("  (SELECT p.pass_at_k FROM job_passk p")
_COST_AT = _TEXT.index("  (SELECT CASE WHEN COUNT(*) > COUNT(c.cost_usd)", _AT)
_END = _TEXT.index("FROM fig f LEFT JOIN named n", _COST_AT)
_PASS_AT_K, _COST = _TEXT[_AT:_COST_AT], _TEXT[_COST_AT:_END]
assert _TEXT.count(_HEAD) == 1 and _PASS_AT_K.endswith(" AS pass_at_k,\n")
assert _COST.endswith(" AS cost_usd\n") and _PASS_AT_K.count("n.name") == 2
JOB_TASK_FIGURES = (_TEXT[:_AT].replace(_HEAD, "CREATE VIEW job_task_figures AS\n")
                    + "  n.name AS named\n" + _TEXT[_END:])
COLUMNS = ("job", "dataset", "task", "name", "trials", "open", "scored", "unscored", "passed",
           "mean", "mean_scored", "retries", "interrupted", "total_tokens", "unknown_usage",
           "wall_s", "mean_reward")  # then pass_at_k, cost_usd: job_tasks' order
JOB_TASKS = (_HEAD + "SELECT " + ", ".join(f"f.{c}" for c in COLUMNS) + ",\n"
             + _PASS_AT_K.replace("n.name", "f.named") + _COST + "FROM job_task_figures f")
VIEWS = ("job_trials", "job_passk", "job_task_figures", "job_tasks", "job_reward_means")


def _fill() -> dict[str, str]:
    dialect = op.get_bind().dialect.name
    return {"wall": WORK.WALL[dialect], "float": SUMMARY.FLOAT[dialect]}


def upgrade() -> None:
    op.execute("DROP VIEW job_tasks")
    for view in (JOB_TASK_FIGURES, JOB_TASKS):
        op.execute(view.format(**_fill()))


def downgrade() -> None:
    op.execute("DROP VIEW job_tasks")
    op.execute("DROP VIEW job_task_figures")
    op.execute(NAMES.JOB_TASKS.format(**_fill()))
