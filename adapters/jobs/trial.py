"""A trial (docs/SPEC.md §13): one task attempted by one agent configuration, its sessions
(attempt 1, 2, … chained by `retry_of`) run until one ends final or the attempts are used.

The one trial rule of `run`, `run --trial`, `job run` and `worker`. What a trial does next
is read from its sessions in the store each time (`next_attempt`), so a resumed run, or a
worker that took a trial over, continues exactly where the last one stopped: sessions a
dead runner left open are first recovered (`sandbox.lost`, evidence kept), and a session
closed `cancelled` or `recovered` without a verdict gives the trial another attempt that
does not count toward `max_attempts` (a harness failure, not the agent's or the
endpoint's). A job's trial runs under its `Lease`, which fences every append, is renewed
under a deadline, and is kept by the sandbox too (a dead man's switch).

The walk: a job claims a trial (adapters/jobs/queue.py) → `Trial.hold` keeps its lease while
`Trial.run` runs its attempts → each attempt is `SessionRunner.run_session`
(adapters/session/runner.py) → the job settles the trial.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from trialledger.adapters.sandbox.deadline import DeadManSwitch
from trialledger.adapters.session.journal import delivery
from trialledger.adapters.session.preflight import StoreTooFull
from trialledger.adapters.session.sessions import SessionResult, Sessions
from trialledger.core import SessionView
from trialledger.core.events import AgentExited
from trialledger.core.steps import NOT_RUN, StepRun, attempt_end, trial_reward
from trialledger.store import LeaseLost, Ledger, StoreUnavailable
from trialledger.store.jobs import UNCOUNTED_CAP, Claim, Jobs
from trialledger.store.ledger import RunnerAlive, gone_from_this_host
from trialledger.store.writer import Fence

if TYPE_CHECKING:
    from trialledger.adapters.tasks.task import Task

log = logging.getLogger(__name__)

FINAL = ("verify", "unverified")
HARNESS_CLOSES = ("cancelled", "recovered")  # a session the harness stopped, not the agent


def finishes(session: Mapping[str, Any]) -> bool:
    """Whether a closed session finishes its trial (SPEC §13): a `verification.*` of it is
    stored — decided `verify`, or `unverified` closed by its runner (its verifier failed).
    One closed `cancelled` or `recovered` before its verification was recorded finishes
    nothing (its row's `verified`, `Trial.sessions`, says which): the attempt runs again."""
    if session["outcome"] == "verify":
        return True
    if session["outcome"] != "unverified":
        return False
    return session["close_reason"] not in HARNESS_CLOSES or bool(session.get("verified"))


def step_finishes(session: Mapping[str, Any]) -> bool:
    """Whether a closed step session ends its step (core/steps.py `StepRun.finished`):
    `finishes`, or closed `NOT_RUN` (its setup.sh or healthcheck failed: nothing ran)."""
    return finishes(session) or session["close_reason"] == NOT_RUN


def next_attempt(sessions: Sequence[Mapping[str, Any]], max_attempts: int, *,
                 finished: Callable[[Mapping[str, Any]], bool] | None = None
                 ) -> tuple[int, str | None] | None:
    """A trial's next (attempt, retry_of) from its closed sessions, oldest first; None when
    its last session finishes it (`finishes`) or `max_attempts` sessions have counted. A
    harness failure — closed `cancelled`, or `recovered` after a crash, without a verdict —
    never uses up an attempt, but only the first `UNCOUNTED_CAP` give one: past them the
    trial ends (so one that fails the same way each time never stays queued). `finished`:
    whether a last session ends the trial (default `finishes`)."""
    last = sessions[-1] if sessions else None
    counted = sum(1 for s in sessions if s["close_reason"] not in HARNESS_CLOSES)
    if ((last is not None and (finished or finishes)(last)) or counted >= max_attempts
            or len(sessions) - counted > UNCOUNTED_CAP):
        return None
    return (int(last["attempt"]) + 1 if last else 1, last["session_id"] if last else None)


def by_attempt(sessions: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """A multi-step trial's sessions, oldest first, grouped by their `attempt` (its step
    sessions, in order)."""
    attempts: list[list[Mapping[str, Any]]] = []
    for row in sessions:
        if attempts and attempts[-1][0]["attempt"] == row["attempt"]:
            attempts[-1].append(row)
        else:
            attempts.append([row])
    return attempts


def fresh_trial_id(task: str) -> str:
    """A plain `run`'s trial id, new each run: `<task>:<12 hex digits>` (a job's trials are
    `uuid5(NS, "<job>:<task>:<k>")`, queued with the job: `store.jobs.trial_id`)."""
    return f"{task}:{uuid.uuid4().hex[:12]}"


@dataclass
class TrialRun:
    """A trial as a run of it left it."""

    trial_id: str
    sessions: list[dict[str, Any]]  # all its sessions (rows of `sessions`), oldest first
    ran: list[SessionResult]  # the sessions this run ran, with their views
    final: SessionView | None = None  # its final session's view (None: it has none)
    error: str | None = None  # why an error no rule foresaw ended it (a held trial, §13)
    # A multi-step trial's reward by its strategy over its last complete attempt's steps
    # (docs/SPEC.md §17; None: no result), and those steps' own (name, rewards)
    rewards: dict[str, float] | None = None
    steps: list[tuple[str, dict[str, float] | None]] | None = None


class Lease:
    """A job trial's hold (SPEC §13, "Claims, leases and fencing"): its token fences every
    append of the trial; it is renewed every lease/3, and kept until a deadline 2·lease/3
    after the start of the last renewal that succeeded. The deadline is watched on its own,
    never through a renewal call: a call that hangs, or whose cancellation waits on a
    silent connection, cannot delay the stop. The sandbox keeps the deadline too (`switch`:
    it kills itself unless extended, even when this process is paused and cannot stop it),
    a twelfth of the lease later (`switch_grace_s`), so a holder that runs always stops its
    session before the sandbox dies under it — a session whose agent the switch killed
    is never verified and graded by a holder whose lease had ended."""

    def __init__(self, jobs: Jobs, claim: Claim, lease_s: float) -> None:
        self.jobs, self.claim, self.lease_s = jobs, claim, lease_s
        self.switch_grace_s = lease_s / 12
        self.switch = DeadManSwitch(2 * lease_s / 3 + self.switch_grace_s)
        self.why: str | None = None  # why it ended before its trial did (None: it did not)
        self.store_failed: StoreUnavailable | None = None  # the store failed the run (why)
        self._deadline = 0.0  # when the hold ends unless renewed (anyio's clock)
        self._error: Exception | None = None  # the last renewal's failure, for the warning

    @property
    def fence(self) -> Fence:
        """What every append of the trial carries: (trial id, lease token)."""
        return self.claim.trial_id, self.claim.token

    async def keep(self, trial: anyio.CancelScope) -> None:
        """Renew the lease until cancelled (the database's expiry counts from a later
        moment than the deadline). Past the deadline — the store down, or a call that hangs
        — or once the trial was taken over, `trial` is cancelled, which stops its sandbox.
        Each renewal also extends the sandbox's own deadline."""
        self._deadline = anyio.current_time() + 2 * self.lease_s / 3
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._renew, trial, tg.cancel_scope)
            while (left := self._deadline - anyio.current_time()) > 0:
                await anyio.sleep(left)
            self.why = "not renewed in time"
            log.warning("lease of trial %s not renewed for %.0f s (%s); stopping its session",
                        self.claim.trial_id, 2 * self.lease_s / 3,
                        self._error or "the store did not answer")
            trial.cancel()
            tg.cancel_scope.cancel()

    async def _renew(self, trial: anyio.CancelScope, keeping: anyio.CancelScope) -> None:
        """Renew every lease/3 (after a failure every lease/10, at most 1 s), moving the
        deadline `keep` watches; a renewal the store refuses (taken over) ends the hold."""
        lease_s = self.lease_s
        while True:
            await anyio.sleep(max(0.0, min(lease_s / 3,
                                           self._deadline - anyio.current_time())))
            started = anyio.current_time()
            try:
                kept = await self.jobs.renew(self.claim, lease_s)
            except Exception as failed:  # the store blinked: again until the deadline
                self._error = failed
                await anyio.sleep(min(1.0, lease_s / 10))
                continue
            if self.why is not None:  # answered after the deadline: the hold had ended
                return
            if not kept:
                self.why = "taken over"
                log.warning("trial %s was taken over; stopping its session",
                            self.claim.trial_id)
                trial.cancel()
                keeping.cancel()
                return
            self._deadline = started + 2 * lease_s / 3
            self.switch.extend(self._deadline - anyio.current_time() + self.switch_grace_s)

    async def end(self, *, settled: bool) -> None:
        """Disarm the sandbox's deadline; a trial not settled is given back to the queue if
        it is still ours (not taken over) — unless the store does not answer within a third
        of the lease: the lease then expires."""
        self.switch.close()
        if settled or self.why == "taken over":
            return
        with (anyio.CancelScope(shield=True), anyio.move_on_after(min(10.0, self.lease_s / 3)),
              contextlib.suppress(StoreUnavailable)):
            await self.jobs.settle(self.claim, "queued")


class Trial:
    """One trial: its id (a job's is `uuid5(NS, "<job>:<task>:<k>")`, as its queue row and
    claim carry it; a plain `run`'s is `fresh_trial_id`), its sessions in the store, its
    next attempt, the recovery of the sessions a dead runner left open, and — a job's
    trial — its lease."""

    def __init__(self, ledger: Ledger, trial_id: str, *, lease: Lease | None = None) -> None:
        self.ledger, self.trial_id, self.lease = ledger, trial_id, lease

    @classmethod
    def fresh(cls, ledger: Ledger, task: str) -> Trial:
        """A new trial of `task` (a plain `run`)."""
        return cls(ledger, fresh_trial_id(task))

    async def sessions(self) -> list[dict[str, Any]]:
        """Its sessions (rows of the `sessions` view), oldest first; the last, when closed
        `cancelled` or `recovered` after grading, says whether its verification is stored
        (`verified`: only then does it finish the trial, `finishes`)."""
        found = await self.ledger.sessions(trial_id=self.trial_id)
        last = found[-1] if found else None
        if last is not None and last["close_reason"] in HARNESS_CLOSES \
                and last["outcome"] == "unverified":
            last["verified"] = await self.ledger.verified(str(last["session_id"]))
        return found

    async def recover(self, sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Its sessions, those still open first closed `recovered` (their journals delivered
        first, SPEC §8): they were left by a runner that died holding the trial. Under a
        lease, the lease says no one else holds it, and the recovery's appends are fenced by
        it; without one, only sessions whose runner is gone are (`RunnerAlive` otherwise)."""
        still_open = [s for s in sessions if s["state"] != "closed"]
        if not still_open:
            return sessions
        if self.lease is None:
            alive = {r for r in await self.ledger.live_runners() if not gone_from_this_host(r)}
            if busy := [s for s in still_open if s["runner_id"] in alive]:
                raise RunnerAlive(f"trial {self.trial_id} has session {busy[0]['session_id']} "
                                  f"running under runner {busy[0]['runner_id']}, which is "
                                  f"alive")
        await self.ledger.recover_sessions(
            [s["session_id"] for s in still_open],
            fence=self.lease.fence if self.lease is not None else None,
            deliver=delivery(self.ledger))
        return await self.sessions()

    async def run(self, runner: Sessions) -> TrialRun:
        """Run its next attempts with `runner` until one ends final, `max_attempts` have
        counted or the uncounted ones are used up (`next_attempt`), reading its sessions
        from the store before each."""
        ran: list[SessionResult] = []
        token = self.lease.claim.token if self.lease is not None else None
        steps = runner.task.steps
        max_attempts = max(1, runner.options.max_attempts)
        while True:
            sessions = await self.recover(await self.sessions())
            step = (await self._next_steps(sessions, runner.task, max_attempts) if steps
                    else next_attempt(sessions, max_attempts))
            if step is None:
                done = TrialRun(self.trial_id, sessions, ran, await self._final(sessions, ran))
                if steps:
                    done.steps = await self._step_rewards(sessions, runner.task)
                    done.rewards = trial_reward([r for _, r in done.steps or []],
                                                runner.task.reward_strategy
                                                ) if done.steps else None
                return done
            if steps:
                ran.extend(await runner.run_steps(attempt=step[0], retry_of=step[1],
                                                  trial_id=self.trial_id, lease=token))
            else:
                ran.append(await runner.run_session(attempt=step[0], retry_of=step[1],
                                                    trial_id=self.trial_id, lease=token))

    async def _next_steps(self, sessions: Sequence[Mapping[str, Any]], task: Task,
                          max_attempts: int) -> tuple[int, str | None] | None:
        """A multi-step trial's next (attempt, retry_of), its attempts being its step
        sessions grouped by `attempt` (docs/SPEC.md §17): None once its last attempt is
        over without a retry (complete, or stopped: core/steps.py `attempt_end`; one
        stopped by a step that could not be set up runs again), or the attempts are used
        as `next_attempt` counts them (one closed by the harness is uncounted); else a new
        attempt from step 1 — also after one left half-run."""
        attempts = by_attempt(sessions)
        if attempts:
            runs = [await self._step_run(row) for row in attempts[-1]]
            end = attempt_end(runs, [step.min_reward for step in task.steps])
            if end.over and not end.retry and not end.rerun:
                return None
        return next_attempt([attempt[-1] for attempt in attempts], max_attempts,
                            finished=lambda _: False)

    async def _step_run(self, row: Mapping[str, Any]) -> StepRun:
        """A step session as core/steps.py weighs it (its view read when it finished)."""
        if not finishes(row):
            return StepRun(str(row["step_name"]), step_finishes(row), None,
                           not_run=row["close_reason"] == NOT_RUN)
        view = await self.ledger.view(str(row["session_id"]))
        return StepRun(str(row["step_name"]), True, view.rewards, agent_failed=any(
            isinstance(event, AgentExited) and (event.data.timed_out
                                                or event.data.return_code != 0)
            for event in view.events))

    async def _rewards(self, row: Mapping[str, Any]) -> dict[str, float] | None:
        return (await self.ledger.view(str(row["session_id"]))).rewards

    async def _step_rewards(self, sessions: Sequence[Mapping[str, Any]], task: Task
                            ) -> list[tuple[str, dict[str, float] | None]] | None:
        """Its last complete attempt's steps (name, rewards): None when its last attempt
        ended for a retry (no attempt completed)."""
        attempts = by_attempt(sessions)
        if not attempts:
            return None
        last = attempts[-1]
        if not step_finishes(last[-1]):
            return None
        return [(str(row["step_name"]), await self._rewards(row) if finishes(row) else None)
                for row in last]

    async def _final(self, sessions: Sequence[Mapping[str, Any]],
                     ran: Sequence[SessionResult]) -> SessionView | None:
        """The view of its final session: the one run last when it is, else read back."""
        if not sessions:
            return None
        final = str(sessions[-1]["session_id"])
        if ran and ran[-1].session_id == final:
            return ran[-1].view
        return await self.ledger.view(final)

    async def hold(self, runner: Callable[[DeadManSwitch], Sessions]
                   ) -> TrialRun | None:
        """Run the trial (a job's, under its lease) with the runner `runner(switch)` makes,
        while the lease is kept (`Lease.keep`). None when the lease ended first — taken
        over, or not renewed in time — or the store failed a call of the run past the
        run's own retries (a statement past its deadline on a loaded server, a connection
        gone silent; `Lease.store_failed`): its session was stopped (its sandbox killed)
        and the trial is left to its next holder, never settled `done` (docs/SPEC.md §13:
        a store outage finishes nothing; the job decides how long it goes on). An error no
        rule foresaw ends this trial alone (`TrialRun.error`), never the job nor the
        trials beside it; a cancellation, an interrupt or a disk too full to start a
        session is raised."""
        lease = self.lease
        assert lease is not None  # a held trial is a job's
        done: TrialRun | None = None
        trial = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lease.keep, trial)
            try:
                with trial:
                    done = await self.run(runner(lease.switch))
            except BaseException as error:
                if _only(error, LeaseLost):
                    lease.why = lease.why or "taken over"
                elif lease.why is None and _only(error, StoreUnavailable) \
                        and not _has(error, StoreTooFull):  # (too full: every run would be)
                    lease.why = "given up"
                    lease.store_failed = first_of(error, StoreUnavailable)
                    log.warning("trial %s: stopped, the store failed it: %s", self.trial_id,
                                lease.store_failed)
                elif lease.why is not None and (_unexpected(error)
                                                or _only(error, StoreUnavailable)):
                    log.warning("trial %s: stopped: %s", self.trial_id, error)
                elif _unexpected(error):
                    done = await self._failed(error)
                else:
                    raise
            tg.cancel_scope.cancel()
        if lease.store_failed is not None:
            return None  # (said above; the job decides whether to go on: JobRunner._hold)
        if lease.why is not None or done is None:
            log.warning("trial %s (%s): its lease was %s; its session was stopped and the "
                        "trial is left to its next holder", self.trial_id, lease.claim.task,
                        lease.why or "not kept")
            return None
        return done

    async def _failed(self, error: BaseException) -> TrialRun:
        """End a held trial whose run raised what no rule foresaw: its open sessions closed
        (`recovered`, evidence kept), the error logged with its traceback, and the reason
        kept (`TrialRun.error`, the queue's `detail`) — the trial is then done, unscored."""
        assert self.lease is not None
        detail = f"the trial ended on an unexpected error: {type(error).__name__}: {error}"
        log.error("trial %s (%s): %s", self.trial_id, self.lease.claim.task, detail,
                  exc_info=(type(error), error, error.__traceback__))
        sessions: list[dict[str, Any]] = []
        try:
            sessions = await self.sessions()
            sessions = await self.recover(sessions)
        except Exception as again:  # e.g. an append the store refuses: the next run recovers
            log.error("trial %s: its sessions could not be closed (%s)", self.trial_id, again)
        return TrialRun(self.trial_id, sessions, [], error=detail[:2000])


def _unexpected(error: BaseException) -> bool:
    """Whether `error` is one trial's own failure (ended alone), not a cancellation, an
    interrupt or the store failing (`Trial.hold` stops the trial; the job goes on while
    the store recovers within its `store_retry_s`)."""
    if isinstance(error, BaseExceptionGroup):
        return all(_unexpected(e) for e in error.exceptions)
    return isinstance(error, Exception) and not isinstance(error, StoreUnavailable)


E = TypeVar("E", bound=BaseException)


def first_of(error: BaseException, kind: type[E]) -> E:
    """`error` itself, or the first `kind` in its group."""
    while isinstance(error, BaseExceptionGroup):
        error = next(e for e in error.exceptions if _has(e, kind))
    assert isinstance(error, kind)
    return error


def _has(error: BaseException, kind: type[BaseException]) -> bool:
    """Whether `error` is `kind`, or a group holding one."""
    if isinstance(error, BaseExceptionGroup):
        return error.split(kind)[0] is not None
    return isinstance(error, kind)


def _only(error: BaseException, kind: type[BaseException]) -> bool:
    """Whether `error` is `kind`, or a group of nothing else (from a task group)."""
    if isinstance(error, BaseExceptionGroup):
        return error.split(kind)[1] is None
    return isinstance(error, kind)


__all__ = ["FINAL", "HARNESS_CLOSES", "UNCOUNTED_CAP", "Lease", "Trial", "TrialRun",
           "by_attempt", "finishes", "first_of", "fresh_trial_id", "next_attempt"]
