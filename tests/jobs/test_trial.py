"""One trial rule (docs/SPEC.md §13, adapters/jobs/trial.py): `run --trial`, a job and the
library's `Trial` continue a trial a dead runner left the same way — its open session
recovered, then its next attempt chained to it — and a job's trial held under a lease
that is taken over stops its session and is left, never settled, to its next holder."""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.runs import in_process, make_task
from tests.store.test_leases import _sleeping, sleep_marker
from trialledger.adapters.demo import samples
from trialledger.adapters.sandbox.deadline import DeadManSwitch
from trialledger.adapters.session.runner import RunOptions, SessionRunner
from trialledger.adapters.tasks.task import Task
from trialledger.store import Ledger
from trialledger.store.jobs import Jobs

# uuid5(c103da3a-5624-571b-8699-c4e4db20453f, "bench:hello:0"): job bench's one trial
JOB_TRIAL = "62ba3711-3ca8-5065-b599-34d0df38b80e"
ORACLE = ["--agent", "oracle"]


def _solve(task: Path, script: str) -> None:
    samples.executable(task / "solution" / "solve.sh", f"#!/bin/sh\n{script}\n")


def _killed_midway(task: Path, *argv: str, marker: str) -> None:
    """`trialledger ARGV` in its own process, SIGKILLed while its oracle sleeps: a runner
    that died holding its trial, the session left open."""
    _solve(task, f"sleep {marker}")
    killed_while_sleeping(*argv, marker=marker)


def killed_while_sleeping(*argv: str, marker: str) -> None:
    """`trialledger ARGV` in its own process, SIGKILLed once a `sleep MARKER` runs (in
    its sandbox)."""
    proc = subprocess.Popen([sys.executable, "-m", "trialledger.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _sleeping(marker):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the oracle never started"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.communicate(timeout=30)


async def _shape(ledger: Ledger, trial: str) -> list[tuple[int, bool, str, str]]:
    """A trial's sessions as (attempt, chained to the one before, close reason, outcome)."""
    sessions = await ledger.sessions(trial_id=trial)
    return [(s["attempt"], s["retry_of"] == (sessions[i - 1]["session_id"] if i else None),
             s["close_reason"], s["outcome"]) for i, s in enumerate(sessions)]


def test_run_trial_a_job_and_the_library_continue_a_dead_runners_trial_alike(
        db: str, tmp_path: Path) -> None:
    hello = make_task(tmp_path / "hello", instruction="wait", test_sh="exit 0\n",
                      solve_sh="#!/bin/sh\nexit 0\n").folder
    _killed_midway(hello, "run", str(hello), "--db", db, *ORACLE, "--trial", "by-run",
                   marker=sleep_marker(31))
    _killed_midway(hello, "run", str(hello), "--db", db, *ORACLE, "--trial", "by-library",
                   marker=sleep_marker(31))
    _killed_midway(hello, "job", "run", "bench", str(hello), "--db", db, *ORACLE,
                   marker=sleep_marker(31))
    _solve(hello, "exit 0")

    by_run = in_process("run", str(hello), "--db", db, *ORACLE, "--trial", "by-run")
    assert by_run.returncode == 0, by_run.stderr
    by_job = in_process("job", "run", "bench", str(hello), "--db", db, *ORACLE)
    assert by_job.returncode == 0, by_job.stderr

    async def by_library() -> dict[str, Any]:
        from trialledger.adapters.jobs.trial import Trial

        async with await Ledger.open(db) as ledger:
            runner = SessionRunner(ledger, Task.load(hello), RunOptions(agent="oracle"))
            ran = await Trial(ledger, "by-library").run(runner)
            assert [r.outcome for r in ran.ran] == ["verify"]  # only the attempt it ran
            return {trial: await _shape(ledger, trial)
                    for trial in ("by-run", "by-library", JOB_TRIAL)}

    shapes = anyio.run(by_library)
    # Each: the dead runner's session recovered (sandbox.lost: a retry, uncounted), then
    # attempt 2 chained to it, decided and verified.
    expected = [(1, True, "recovered", "retry"), (2, True, "normal", "verify")]
    assert shapes == {"by-run": expected, "by-library": expected, JOB_TRIAL: expected}
    (line,) = by_run.stdout.splitlines()  # the session it ran, not the recovered one
    assert line.endswith(" verify reward=1")
    again = in_process("run", str(hello), "--db", db, *ORACLE, "--trial", "by-run")
    assert (again.returncode, again.stdout) == (0, by_run.stdout)  # decided: nothing runs


@pytest.mark.anyio
async def test_a_held_trial_taken_over_stops_its_session_and_is_left_to_its_next_holder(
        db: str, tmp_path: Path) -> None:
    from trialledger.adapters.jobs.trial import Lease, Trial

    marker = sleep_marker(31)
    task = make_task(tmp_path / "sleeper", instruction="wait", test_sh="exit 0\n",
                     solve_sh=f"#!/bin/sh\nsleep {marker}\n")
    config = {"agent": "oracle", "model": "", "settings": {}, "grants": [], "k": 1,
              "max_attempts": 1}

    def runner(ledger: Ledger, switch: DeadManSwitch) -> SessionRunner:
        return SessionRunner(ledger, task, RunOptions(agent="oracle", switch=switch))

    async def wait_for(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"{what} within 60 s")
            await anyio.sleep(0.05)

    async with await Ledger.open(db) as ledger:
        jobs = Jobs(ledger)
        await jobs.define("held", config, [(task.name, str(task.folder))])
        first = await jobs.claim("held", "first", 3.0)
        assert first is not None
        lease = Lease(jobs, first, 3.0)
        outcome: list[Any] = []

        async def hold() -> None:
            outcome.append(await Trial(ledger, first.trial_id, lease=lease).hold(
                functools.partial(runner, ledger)))
            await lease.end(settled=False)

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await wait_for(lambda: _sleeping(marker), "the oracle never started")
            assert await jobs.settle(first, "queued")  # let go of, then taken over
            second = await jobs.claim("held", "second", 60)
            assert second is not None and second.trial_id == first.trial_id
        assert outcome == [None] and lease.why == "taken over" and second is not None
        await wait_for(lambda: not _sleeping(marker), "the sandbox was not stopped")
        (left,) = await ledger.sessions(trial_id=first.trial_id)
        assert left["state"] != "closed"  # its close was fenced: the next holder's to do
        assert [t["state"] for t in await jobs.trials("held")] == ["running"]

        _solve(task.folder, "exit 0")
        taken = Lease(jobs, second, 60)
        ran = await Trial(ledger, second.trial_id, lease=taken).hold(
            functools.partial(runner, ledger))
        assert ran is not None and ran.error is None
        assert await jobs.settle(second, "done")
        await taken.end(settled=True)
        # The first holder's own close, refused in the store, was kept in its journal,
        # which the next holder delivered before recovering (SPEC §8): an uncounted attempt.
        assert await _shape(ledger, first.trial_id) == [
            (1, True, "cancelled", "interrupted"), (2, True, "normal", "verify")]
        assert ran.final is not None and ran.final.rewards == {"reward": 1.0}
