"""A multi-step trial's rules (SPEC §17), as Harbor's `trial/multi_step.py`, `trial.py` and
`trial/queue.py` have them: when an attempt goes on to its next step, when it is over, when
the trial is retried from step 1, and the trial's reward from its steps'.

>>> trial_reward([{"reward": 1.0}, {"reward": 0.0, "style": 1.0}], "mean")
{'reward': 0.5, 'style': 0.5}
>>> trial_reward([{"reward": 1.0}, None], "final") is None
True
>>> gate_failure({"reward": 0.0}, {"reward": 1.0})
'reward=0.0 below min_reward 1.0'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Strategy = Literal["mean", "final"]
Rewards = Mapping[str, float]
# A step session's `session.closed` reason when its setup.sh or its healthcheck failed: no
# agent and no verifier ran, the step is over without a result (Harbor's step exception:
# its `_should_stop_after_step` stops the attempt; its queue retries the trial for the
# `RuntimeError` or `HealthcheckError` only when told to retry: `AttemptEnd.rerun`).
NOT_RUN = "step_not_run"


def gate_failure(rewards: Rewards | None, min_reward: Mapping[str, float] | None
                 ) -> str | None:
    """Harbor's `_min_reward_failure`: the first gated key below its threshold (a key
    missing, or no rewards at all, counts as -inf) as `key=value below min_reward
    threshold`; None when the gate holds or there is none."""
    for key, threshold in (min_reward or {}).items():
        actual = (rewards or {}).get(key, -math.inf)
        if actual < threshold:
            return f"{key}={actual} below min_reward {threshold}"
    return None


@dataclass(frozen=True)
class StepRun:
    """One step session of an attempt, as the store has it."""

    name: str
    finished: bool  # it ends its step: verified, unverified, or closed `NOT_RUN`
    rewards: Rewards | None  # its verification's rewards; None: it got no result
    not_run: bool = False  # closed `NOT_RUN`: its setup.sh or healthcheck failed
    # its agent timed out or exited non-zero (Harbor's AgentTimeoutError or
    # NonZeroAgentExitCodeError, which its queue never retries a trial for)
    agent_failed: bool = False


@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt's steps so far leave it."""

    over: bool  # no step of it is left to run (complete, or stopped)
    retry: bool  # its last step did not finish: the trial is retried from step 1
    stopped: str | None = None  # why it stopped early: `step 'x': why` (gap steps_stopped)
    # stopped by a step that could not be set up: the trial runs again from step 1 while
    # it has attempts left (`--max-attempts`), as Harbor's queue retries a step exception
    rerun: bool = False


def attempt_end(runs: Sequence[StepRun], gates: Sequence[Mapping[str, float] | None]
                ) -> AttemptEnd:
    """Where an attempt stands after `runs` (its step sessions in order; `gates`: each
    step's `min_reward`, one per step of the task). A step that did not finish (decided
    `retry`, or closed by the harness) ends the attempt for a retry; one without a result,
    or whose gate fails, stops it (as Harbor's `_should_stop_after_step`) — one that could
    not be set up for a rerun when attempts are left; after the last step it is complete;
    else its next step runs."""
    if not runs:
        return AttemptEnd(over=False, retry=False)
    last = runs[-1]
    if not last.finished:
        return AttemptEnd(over=True, retry=True)
    if last.rewards is None:  # (rerun only when every exception of it is one Harbor
        # retries: the step's own, not an earlier step's agent failure)
        rerun = last.not_run and not any(run.agent_failed for run in runs[:-1])
        return AttemptEnd(over=True, retry=False, rerun=rerun,
                          stopped=f"step {last.name!r}: no verification result")
    if (failure := gate_failure(last.rewards, gates[len(runs) - 1])) is not None:
        return AttemptEnd(over=True, retry=False, stopped=f"step {last.name!r}: {failure}")
    return AttemptEnd(over=len(runs) >= len(gates), retry=False)


def trial_reward(steps: Sequence[Rewards | None], strategy: Strategy
                 ) -> dict[str, float] | None:
    """The trial's rewards over the steps that ran, in order (None: a step without a
    result). `final`: the last step's, verbatim. `mean`: each key's mean over the steps
    with a result, a key a step lacks counting 0; None when no step has any key."""
    if not steps:
        return None
    if strategy == "final":
        last = steps[-1]
        return dict(last) if last is not None else None
    results = [step for step in steps if step is not None]
    keys = sorted({key for result in results for key in result})
    if not keys:
        return None
    return {key: sum(result.get(key, 0.0) for result in results) / len(results)
            for key in keys}
