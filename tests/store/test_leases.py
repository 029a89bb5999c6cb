"""Leases that end (docs/SPEC.md §13): a holder whose renewal misses its deadline — the
store down, or a renewal that hangs on a stalled connection — stops its trial's sandbox and
leaves the trial to its next holder, never settling it `done`; a worker that cannot prepare
an environment leaves the trials queued; a new holder's recovery is fenced by its lease."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.jobs.test_jobs import _pg_rows
from tests.pg import PASSWORD, SUPERUSER, PostgresServer
from tests.runs import make_task

LEASE_S = 3.0
# The oracle's sleep: long enough to outlive every check, and unique to this test process, so
# a test finds its own oracle, never one of another run sharing the machine (a CI beside a
# developer's run found and paused each other's workers).
SLEEP = f"12.{os.getpid():07d}"


def _marker_alive() -> bool:
    """Whether the oracle's `sleep SLEEP` runs anywhere on this host (inside a sandbox)."""
    return _sleeping(SLEEP)


def sleep_marker(whole: int) -> str:
    """A `sleep` duration of about `whole` seconds no other test, worker or run on this
    machine uses at the same time (a test's two database variants run at once on two
    workers): the pid and the clock in its fraction."""
    return f"{whole}.{os.getpid():07d}{time.monotonic_ns() % 10**6:06d}"


def _sleeping(seconds: str) -> bool:
    """Whether a `sleep SECONDS` runs anywhere on this host (inside a sandbox)."""
    wanted = f"sleep\0{seconds}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "cmdline").read_bytes().startswith(wanted):
                    return True
    return False


def _wait(condition: Callable[[], bool], within_s: float, what: str) -> float:
    """Poll `condition` until it holds (the seconds it took), else fail naming `what`."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if condition():
            return time.monotonic() - start
        time.sleep(0.05)
    pytest.fail(f"{what} within {within_s} s")


@pytest.fixture
def sleeper(tmp_path: Path) -> Path:
    make_task(tmp_path / "sleeper", instruction="wait", test_sh="exit 0\n",
              solve_sh=f"#!/bin/sh\nsleep {SLEEP}\n")
    return tmp_path / "sleeper"


@contextlib.contextmanager
def _job_run(db: str, task: Path, name: str = "leases") -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "trialledger.cli", "job", "run", name, str(task), "--db", db,
         "--agent", "oracle", "--lease-s", str(LEASE_S), "--runner-id", "holder"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _ran_to_its_decision(db: str, task: Path, first: subprocess.Popen[str]) -> None:
    """The first run ends without a traceback; the trial is then decided (by that run, or
    by a resumed one) with one uncounted, undecided attempt before the decided one."""
    _, err = first.communicate(timeout=120)
    assert "Traceback" not in err and "UnboundLocalError" not in err, err
    if _pg_rows(db, "SELECT state FROM job_queue") != [("done",)]:
        with _job_run(db, task) as resumed:
            _, err = resumed.communicate(timeout=120)
            assert resumed.returncode == 0 and "Traceback" not in err, err
    assert _pg_rows(db, "SELECT state FROM job_queue") == [("done",)]
    sessions = _pg_rows(db, "SELECT attempt, close_reason, outcome FROM sessions "
                            "ORDER BY created_at")
    assert sessions[0][1] in ("cancelled", "recovered") and sessions[0][2] != "verify"
    assert sessions[-1][2] == "verify" and len(sessions) >= 2, sessions


@pytest.mark.slow
def test_a_store_outage_past_two_thirds_of_a_lease_stops_the_trial_never_settles_it(
        sleeper: Path, postgres: PostgresServer) -> None:
    """The database stops while the agent runs: within 2·lease/3 (plus the stop) the
    sandbox is killed; the trial is not settled `done`; nothing crashes; it is decided
    once the store is back."""
    db = postgres.create_database()
    data = str(postgres.folder / "data")
    with _job_run(db, sleeper) as proc:
        _wait(_marker_alive, 60, "the oracle did not start")
        postgres._run("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        try:
            took = _wait(lambda: not _marker_alive(), 2 * LEASE_S / 3 + 2.5,
                         "the sandbox was not stopped while the store was away")
            assert took < float(SLEEP) - 2  # stopped, not ended by itself
            time.sleep(LEASE_S)  # the outage outlasts the lease
        finally:
            postgres.start_again()
        _ran_to_its_decision(db, sleeper, proc)


def _backends(postgres: PostgresServer, db: str, where: str = "true") -> list[int]:
    """The server processes serving `db` now (the job run's connections), those `where`
    holds for."""
    done = subprocess.run(
        ["psql", "-h", "127.0.0.1", "-p", str(postgres.port), "-U", SUPERUSER, "-d",
         "postgres", "-Atc", f"SELECT pid FROM pg_stat_activity WHERE datname = "
                             f"'{db.rsplit('/', 1)[1]}' AND pid <> pg_backend_pid() "
                             f"AND ({where})"],
        env={**os.environ, "PGPASSWORD": PASSWORD}, capture_output=True, text=True, check=True)
    return [int(pid) for pid in done.stdout.split()]


def _silenced(postgres: PostgresServer, db: str) -> list[int]:
    """Every backend of `db` made silent (SIGSTOP): no reset, no answer. One the worker
    was paused inside a transaction of is ended instead: stopped, it would hold its row
    and advisory locks for as long as the test keeps it stopped, which no server does (a
    restarted one drops them), and every claim would wait on them for ever."""
    for pid in _backends(postgres, db, "xact_start IS NOT NULL"):
        os.kill(pid, signal.SIGTERM)  # pg_terminate_backend: its client sees a reset
    silent = _backends(postgres, db, "xact_start IS NULL")
    for pid in silent:
        os.kill(pid, signal.SIGSTOP)
    return silent


@pytest.mark.slow
def test_a_renewal_that_hangs_is_timed_out(sleeper: Path, postgres: PostgresServer) -> None:
    """Every backend of the job's connections is paused (SIGSTOP): the renewal hangs on
    its connection, yet the sandbox is killed within 2·lease/3; resumed, the backends
    answer again and the trial is decided."""
    db = postgres.create_database()
    with _job_run(db, sleeper) as proc:
        _wait(_marker_alive, 60, "the oracle did not start")
        paused = _backends(postgres, db)
        assert paused
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            took = _wait(lambda: not _marker_alive(), 2 * LEASE_S / 3 + 2.5,
                         "the sandbox was not stopped while the renewal hung")
            assert took < float(SLEEP) - 2
        finally:
            for pid in paused:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        _ran_to_its_decision(db, sleeper, proc)


def _define(db: str, name: str, task: Path) -> None:
    """Create job `name` of the oracle on `task` (one trial), for a worker to join."""
    from trialledger.adapters.jobs.queue import job_config
    from trialledger.adapters.session.runner import RunOptions
    from trialledger.store import Ledger
    from trialledger.store.jobs import Jobs

    async def define() -> None:
        async with await Ledger.open(db) as ledger:
            await Jobs(ledger).define(name, job_config(RunOptions(agent="oracle"), 1, 1),
                                      [(task.name, str(task))])

    anyio.run(define)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["worker", "job run"])
def test_a_worker_paused_past_its_lease_while_the_store_went_silent_claims_again(
        sleeper: Path, postgres: PostgresServer, reachable_tmp: Path, command: str) -> None:
    """The worker is paused (SIGSTOP) while its oracle runs, past its lease; meanwhile the
    server stops answering on the worker's connections — their backends SIGSTOPped, as a
    restart behind a proxy or a failover leaves them: no reset, no answer. Resumed, the
    worker stops its trial, releases its session folder and claims the trial again on new
    connections (it was hanging for ever on a pooled connection's check); once the old
    backends answer again the trial is decided once. The same for the job's own `job
    run`, which holds its trials under leases as a worker does."""
    db = postgres.create_database()
    if command == "worker":
        _define(db, "paused", sleeper)
        argv = ["worker", "--job", "paused"]
    else:
        argv = ["job", "run", "paused", str(sleeper), "--agent", "oracle"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trialledger.cli", *argv, "--db", db,
         "--lease-s", str(LEASE_S), "--runner-id", "paused"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(reachable_tmp)})
    silent: list[int] = []
    try:
        _wait(_marker_alive, 60, "the oracle did not start")
        first = list(reachable_tmp.glob("trialledger-*"))
        assert len(first) == 1, first
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(LEASE_S + 1)  # past the lease: the trial may be taken over now
        silent = _silenced(postgres, db)  # the paused worker's connections, every one
        assert silent
        os.kill(proc.pid, signal.SIGCONT)

        def claimed_again() -> bool:
            return (not first[0].exists() and len(_pg_rows(
                db, "SELECT 1 FROM sessions WHERE runner_id = 'paused'")) >= 2)

        _wait(claimed_again, 45, f"the resumed {command} did not release its session folder and "
                                 "claim the trial again")
        assert proc.poll() is None  # working the trial again, not ended by the outage
    finally:
        for pid in silent:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert _pg_rows(db, "SELECT state FROM job_queue") == [("done",)]
    sessions = _pg_rows(db, "SELECT close_reason, outcome FROM sessions ORDER BY created_at")
    assert sessions[0][0] in ("cancelled", "recovered") and sessions[0][1] != "verify"
    assert [s for s in sessions if s[1] == "verify"] == [sessions[-1]], sessions
    assert not list(reachable_tmp.glob("trialledger-*"))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["worker", "job run"])
def test_a_worker_paused_past_its_lease_releases_its_folder_while_the_store_is_down(
        sleeper: Path, postgres: PostgresServer, reachable_tmp: Path, command: str) -> None:
    """The worker is paused past its lease and PostgreSQL stops meanwhile: resumed, the
    worker stops its trial and removes its session folder while the store is still down —
    its session's close waits for the store a third of the lease, then is journalled
    (it waited the runner's `store_retry_s`, 120 s, holding the folder). Once the store is
    back, the trial is decided once. The same for the job's own `job run`."""
    db = postgres.create_database()
    if command == "worker":
        _define(db, "down", sleeper)
        argv = ["worker", "--job", "down"]
    else:
        argv = ["job", "run", "down", str(sleeper), "--agent", "oracle"]
    data = str(postgres.folder / "data")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trialledger.cli", *argv, "--db", db,
         "--lease-s", str(LEASE_S), "--runner-id", "paused"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(reachable_tmp)})
    try:
        _wait(_marker_alive, 60, "the oracle did not start")
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(LEASE_S + 1)  # past the lease
        postgres._run("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        try:
            os.kill(proc.pid, signal.SIGCONT)
            _wait(lambda: not list(reachable_tmp.glob("trialledger-*")), 20,
                  f"the resumed {command} kept its session folder while the store was down")
            assert proc.poll() is None  # it claims again once the store is back
        finally:
            postgres.start_again()
        _, err = proc.communicate(timeout=150)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert _pg_rows(db, "SELECT state FROM job_queue") == [("done",)]
    sessions = _pg_rows(db, "SELECT close_reason, outcome FROM sessions ORDER BY created_at")
    assert sessions[0][0] in ("cancelled", "recovered") and sessions[0][1] != "verify"
    assert [s for s in sessions if s[1] == "verify"] == [sessions[-1]], sessions


@pytest.mark.anyio
async def test_a_worker_that_cannot_prepare_a_task_leaves_its_trials_queued(
        tmp_path: Path, db: str, caplog: pytest.LogCaptureFixture) -> None:
    """Only the job's own run marks a task `environment_failed`, and never a trial another
    holder runs under a live lease."""
    from trialledger.adapters.jobs.queue import JobRunner, job_config
    from trialledger.adapters.session.runner import RunOptions
    from trialledger.store import Ledger
    from trialledger.store.jobs import Jobs

    task = make_task(tmp_path / "broken", instruction="x", test_sh="exit 0\n",
                     solve_sh="#!/bin/sh\nexit 0\n",
                     toml='[environment]\nimage_archive = "missing.tar"\n')
    options = RunOptions(agent="oracle")
    async with await Ledger.open(db) as ledger:
        jobs = Jobs(ledger)
        await jobs.define("env", job_config(options, 2, 1), [(task.name, str(task.folder))])
        held = await jobs.claim("env", "another-worker", 60)
        assert held is not None

        async def states() -> dict[str, str]:
            return {t["trial_id"]: t["state"] for t in await jobs.trials("env")}

        with caplog.at_level(logging.WARNING):
            await JobRunner(ledger, "env", [task], options, k=2).run(define=False)
        assert "stay queued" in caplog.text
        after_worker = await states()
        assert after_worker.pop(held.trial_id) == "running"
        assert list(after_worker.values()) == ["queued"]
        await JobRunner(ledger, "env", [task], options, k=2).run()
        after_own = await states()
        assert after_own.pop(held.trial_id) == "running"  # its holder settles it
        assert list(after_own.values()) == ["environment_failed"]
        assert await jobs.settle(held, "done")


@pytest.mark.anyio
async def test_a_new_holders_recovery_is_fenced_by_its_lease(db: str) -> None:
    """A holder whose lease was taken over in turn cannot close the old session: its
    `recovered` appends are refused in their own transaction; the live holder's go through."""
    from tests.scenarios import claimed_session
    from trialledger.store import LeaseLost, Ledger

    async with await Ledger.open(db) as ledger:
        jobs, first, seeded, _ = await claimed_session(ledger, "first")
        await anyio.sleep(0.5)
        second = await jobs.claim("f", "second", 0.2)  # would recover, but stalls
        assert second is not None
        await anyio.sleep(0.5)
        third = await jobs.claim("f", "third", 60)
        assert third is not None and third.trial_id == first.trial_id
        with pytest.raises(LeaseLost):
            await ledger.recover_sessions([seeded.session_id],
                                          fence=(second.trial_id, second.token))
        assert len(await ledger.events(seeded.session_id)) == 1
        closed = await ledger.recover_sessions([seeded.session_id],
                                               fence=(third.trial_id, third.token))
        assert closed == [seeded.session_id]
        assert (await ledger.view(seeded.session_id)).state == "closed"


@pytest.mark.anyio
async def test_a_taken_over_holder_cannot_renew_its_lease(db: str) -> None:
    """Renewal goes by the lease's token: once another worker took the trial over, the old
    holder's renewals fail (so it stops its sandbox) and never push the new lease out."""
    from tests.scenarios import claimed_session
    from trialledger.store import Ledger

    async with await Ledger.open(db) as ledger:
        jobs, first, _, _ = await claimed_session(ledger, "first")
        await anyio.sleep(0.5)  # the 0.2 s lease expired
        second = await jobs.claim("f", "second", 0.5)
        assert second is not None and second.trial_id == first.trial_id
        assert not await jobs.renew(first, 3600)
        await anyio.sleep(1.0)  # past the second holder's own lease: it was not renewed
        third = await jobs.claim("f", "third", 60)
        assert third is not None and third.trial_id == first.trial_id
        assert not await jobs.renew(second, 60) and await jobs.renew(third, 60)



@pytest.mark.anyio
async def test_a_renewal_whose_cancellation_waits_still_ends_the_hold_at_its_deadline(
        tmp_path: Path) -> None:
    """The first renewal succeeds; the next one hangs on its connection, and so does its
    cancellation (a rollback on a silent server, shielded as a pool's clean-up is): the
    trial is still cancelled at the deadline, 2·lease/3 after the last good renewal started
    — never once the call gives up — and the sandbox's own switch fires a twelfth of the
    lease later, so the holder always stops its session first."""
    from tests.scenarios import claimed_session
    from trialledger.adapters.jobs.trial import Lease
    from trialledger.store import Ledger
    from trialledger.store.jobs import Jobs

    class Stalling(Jobs):
        renewals = 0

        async def renew(self, claim: Any, lease_s: float) -> bool:
            self.renewals += 1
            if self.renewals == 1:
                return await super().renew(claim, lease_s)
            with anyio.CancelScope(shield=True):
                await anyio.sleep(1.5 * LEASE_S)  # a silent connection, even when cancelled
            return True

    async with await Ledger.open(str(tmp_path / "t.db")) as ledger:
        _, claim, _, _ = await claimed_session(ledger, "holder", LEASE_S)
        lease = Lease(Stalling(ledger), claim, LEASE_S)
        trial = anyio.CancelScope()
        with anyio.fail_after(8 * LEASE_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lease.keep, trial)
                started = anyio.current_time()
                with trial:
                    await anyio.sleep(3 * LEASE_S)
                stopped = anyio.current_time() - started
                tg.cancel_scope.cancel()
        lease.switch.close()
    assert trial.cancelled_caught and lease.why == "not renewed in time"
    # the first renewal started at lease/3: the deadline is 2·lease/3 later
    assert LEASE_S - 0.05 < stopped < LEASE_S + 0.5, stopped
    assert lease.switch_grace_s == LEASE_S / 12


@pytest.mark.slow
def test_a_paused_worker_s_sandbox_stops_itself_before_the_lease_expires(
        tmp_path: Path, reachable_tmp: Path) -> None:
    """The dead man's switch (docs/SPEC.md §13): the worker is paused (SIGSTOP) while its
    agent writes a heartbeat every 100 ms; the sandbox kills itself 2·lease/3 after the
    last renewal, so no heartbeat is written after the lease's expiry — before another
    holder could take the trial over."""
    make_task(tmp_path / "beater", instruction="beat", test_sh="exit 0\n",
              solve_sh="#!/bin/sh\nwhile true; do date +%s.%N > beat.new; mv beat.new heartbeat; "
                       "sleep 0.1; done\n")
    folders = reachable_tmp  # the session folders: the sandbox user passes through it
    proc = subprocess.Popen(
        [sys.executable, "-m", "trialledger.cli", "job", "run", "beats", str(tmp_path / "beater"),
         "--db", str(tmp_path / "t.db"), "--agent", "oracle", "--lease-s", str(LEASE_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(folders)})
    try:
        def beats() -> list[Path]:
            return list(folders.glob("trialledger-*/work/heartbeat"))

        _wait(lambda: bool(beats()) and beats()[0].stat().st_size > 0, 60,
              "the agent wrote no heartbeat")
        heartbeat = beats()[0]
        os.kill(proc.pid, signal.SIGSTOP)
        paused = time.time()
        time.sleep(LEASE_S + 1.5)  # past the lease's expiry, the worker still paused
        last = float(heartbeat.read_text())
        time.sleep(0.5)
        assert float(heartbeat.read_text()) == last, "the agent still writes"
        assert last < paused + LEASE_S, (
            f"a heartbeat {last - paused:.1f} s after the pause, past the lease's expiry")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_a_paused_workers_container_stops_itself_daemons_and_all(
        tmp_path: Path, reachable_tmp: Path) -> None:
    """The same under `verifier_isolation = harbor` (an image's container): the container
    lives while the worker renews — past the first deadline, so its PID 1 and the agent
    never split the renewals — and once the worker is paused it ends, with the agent and
    the daemon the agent detached from its group."""
    from tests.sandbox.test_range_mode import _debian_into

    task = tmp_path / "beater"
    # each beat is renamed into place: a reader never sees a file half-written
    beat = "while true; do date +%s.%N > /app/$1.new; mv /app/$1.new /app/$1.beat; sleep 0.1; done"
    make_task(task, instruction="beat", test_sh="exit 0\n",
              toml='[environment]\nrootfs = "rootfs.tar"\n',
              solve_sh=f"#!/bin/bash\nmkdir -p /app\nsetsid bash -c '{beat}' _ daemon &\n"
                       f"bash -c '{beat}' _ agent\n")
    _debian_into(task)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trialledger.cli", "job", "run", "beats", str(task),
         "--db", str(tmp_path / "t.db"), "--agent", "oracle", "--lease-s", str(LEASE_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(reachable_tmp)})
    try:
        def beats() -> list[Path]:
            return sorted(reachable_tmp.glob("trialledger-*/upper/app/*.beat"))

        _wait(lambda: len(beats()) == 2 and all(b.stat().st_size for b in beats()), 60,
              "the agent and its daemon wrote no heartbeat")
        time.sleep(LEASE_S)  # past 2·lease/3: renewed, the container still runs
        for heartbeat in beats():
            assert time.time() - float(heartbeat.read_text()) < 1.5, heartbeat.name
        os.kill(proc.pid, signal.SIGSTOP)
        paused = time.time()
        time.sleep(LEASE_S + 1.5)
        last = {b.name: float(b.read_text()) for b in beats()}
        time.sleep(0.5)
        assert {b.name: float(b.read_text()) for b in beats()} == last, "still writing"
        assert all(at < paused + LEASE_S for at in last.values()), (last, paused)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.communicate()
