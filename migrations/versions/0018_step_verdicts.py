"""A multi-step trial's verdict as Harbor's `reward_valid` gives it (docs/SPEC.md §17).

`job_trials` scored a trial when its final session was decided `verify` with a valid
reward. A multi-step trial whose last step never got a verdict — its setup.sh failed, so
it was closed `step_not_run` — was then unscored, where Harbor keeps the trial's reward
over the steps with a result and counts it valid (its step exception, a `RuntimeError`,
leaves the reward valid). Now a multi-step trial is scored when it has a reward at its
final session (`trial_rewards`) and every step session of its last attempt either was
decided `verify` with a valid reward or was closed `step_not_run` after its setup.sh
failed; a step whose healthcheck failed (Harbor's `HealthcheckError`), whose verifier
failed or whose reward does not count leaves it unscored, as Harbor's error table does.
`passed` and the 0.0 of a verified trial without rewards follow the same verdict; a
one-step trial is scored as before. The views over `job_trials` are rebuilt as revision
0017 left them.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

from __future__ import annotations

import importlib
from types import ModuleType

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def _revision(name: str) -> ModuleType:
    return importlib.import_module(f"trialledger.migrations.versions.{name}")


SUMMARY, WORK, REWARDS, NAMES = (_revision("0010_job_summary"), _revision("0011_work_time"),
                                 _revision("0016_trial_rewards"),
                                 _revision("0017_trial_reward_names"))

_ONE_STEP = "f.outcome = 'verify' AND fo.reward_valid = 1"
VERDICT = f"""(({_ONE_STEP} AND f.step_index IS NULL)
    OR (f.step_index IS NOT NULL AND rw.names IS NOT NULL AND NOT EXISTS (
      SELECT 1 FROM sessions u LEFT JOIN outcomes uo ON uo.session_id = u.session_id
      WHERE u.trial_id = f.trial_id AND u.attempt = f.attempt
        AND NOT ((u.outcome = 'verify' AND uo.reward_valid = 1)
                 OR (u.close_reason = 'step_not_run' AND NOT EXISTS (
                   SELECT 1 FROM gaps g WHERE g.session_id = u.session_id
                     AND g.code = 'step_healthcheck_failed'))))))"""
assert REWARDS.JOB_TRIALS.count(_ONE_STEP) == 3
JOB_TRIALS = REWARDS.JOB_TRIALS.replace(_ONE_STEP, VERDICT)


def _rebuild(job_trials: str) -> None:
    dialect = op.get_bind().dialect.name
    for name in reversed(REWARDS.VIEWS):
        op.execute(f"DROP VIEW {name}")
    fill = {"wall": WORK.WALL[dialect], "float": SUMMARY.FLOAT[dialect]}
    for view in (job_trials, NAMES.JOB_PASSK, NAMES.JOB_TASKS, REWARDS.JOB_REWARD_MEANS):
        op.execute(view.format(**fill))


def upgrade() -> None:
    _rebuild(JOB_TRIALS)


def downgrade() -> None:
    _rebuild(REWARDS.JOB_TRIALS)
