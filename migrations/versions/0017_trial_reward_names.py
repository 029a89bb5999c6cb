"""A multi-step trial's reward per name in every figure (docs/SPEC.md §13, §17).

Revision 0016 read a trial's rewards through `trial_rewards` in `job_trials` and
`job_reward_means`, but `job_tasks` and `job_passk` still read a trial's reward names and
their values (a figure with several names: a row per name, pass@k per name) from its final
session's own `rewards` rows — a `mean` multi-step trial's last step's values, not its
strategy's. Now they read them from `final_rewards`, a common table of the views: each
trial's rewards at its final session as `trial_rewards` gives them, computed once per query.
(Through the view inlined at each of the four places that read them, PostgreSQL took 40
times longer to plan the views; as one common table referenced several times both
databases compute it once, and PostgreSQL 15 plans `job_tasks` in 8.7 ms where revision
0016's took 6.8, `job_passk` in 3.7 ms where it took 2.8 — medians of seven plans.)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def _revision(name: str) -> ModuleType:
    return importlib.import_module(f"trialledger.migrations.versions.{name}")


SUMMARY, WORK, REWARDS = (_revision("0010_job_summary"), _revision("0011_work_time"),
                          _revision("0016_trial_rewards"))

# Each finished trial's rewards at its final session (by its strategy).
FINAL_REWARDS = """final_rewards AS (
  SELECT r.session_id, r.name, r.value FROM trial_rewards r
  JOIN job_trials t ON t.final_session_id = r.session_id
),
"""
_FIRST = "\ntrial AS ("  # the first common table of 0010's `cover`, which the views share
# Where a figure reads a trial's reward names and values at its final session
_READS = (("FROM rewards r WHERE r.session_id = t.final_session_id",
           "FROM final_rewards r WHERE r.session_id = t.final_session_id"),
          ("JOIN rewards r ON r.session_id = c.final_session_id",
           "JOIN final_rewards r ON r.session_id = c.final_session_id"),
          ("(SELECT r.value FROM rewards r\n      WHERE r.session_id = x.final_session_id",
           "(SELECT r.value FROM final_rewards r\n      WHERE r.session_id = x.final_session_id"))


def by_strategy(view: str) -> str:
    """`view` reading each trial's reward names and values from `final_rewards`."""
    assert view.count(_FIRST) == 1
    view = view.replace(_FIRST, f"\n{FINAL_REWARDS}trial AS (")
    for old, new in _READS:
        assert old in view, old
        view = view.replace(old, new)
    assert not re.search(r"(?<!_)\brewards r\b", view)  # (every read is through it)
    return view


JOB_PASSK, JOB_TASKS = by_strategy(REWARDS.JOB_PASSK), by_strategy(REWARDS.JOB_TASKS)


def _rebuild(views: tuple[str, str, str, str]) -> None:
    dialect = op.get_bind().dialect.name
    for name in reversed(REWARDS.VIEWS):
        op.execute(f"DROP VIEW {name}")
    fill = {"wall": WORK.WALL[dialect], "float": SUMMARY.FLOAT[dialect]}
    for view in views:
        op.execute(view.format(**fill))


def upgrade() -> None:
    _rebuild((REWARDS.JOB_TRIALS, JOB_PASSK, JOB_TASKS, REWARDS.JOB_REWARD_MEANS))


def downgrade() -> None:
    _rebuild((REWARDS.JOB_TRIALS, REWARDS.JOB_PASSK, REWARDS.JOB_TASKS,
              REWARDS.JOB_REWARD_MEANS))
