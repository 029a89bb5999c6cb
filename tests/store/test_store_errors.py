"""Store errors by kind (store/errors.py): a constraint the database enforces refuses a
write at once, as `IntegrityViolation` naming the constraint — never `StoreUnavailable`, so
no caller rides it out for its `store_retry_s` — while an outage (SQLite locked by another
writer, PostgreSQL stopped) is still `StoreUnavailable` and ridden out. Real stores: SQLite
files and the PostgreSQL fixture; then each kind of driver error by its class or SQLSTATE."""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
import time
from pathlib import Path

import anyio
import pytest
from sqlalchemy import exc, text

from tests.pg import PostgresServer
from trialledger.adapters.jobs.queue import JobRunner
from trialledger.adapters.session.runner import RunOptions
from trialledger.store import IntegrityViolation, Ledger, StatementRefused, StoreUnavailable
from trialledger.store.errors import store_error
from trialledger.store.jobs import Jobs, trial_id

RETRY_S = 600.0  # how long a caller rides out an outage: far past every deadline below
CONFIG = {"agent": "nop", "model": "", "settings": {}, "grants": [], "k": 1, "max_attempts": 1}


async def _with_a_stolen_trial_id(ledger: Ledger) -> None:
    """Job `a`, whose queue holds (as no code of ours would write it) the trial id job `b`
    will give its task `alpha`: queuing `b` meets the queue's primary key."""
    await Jobs(ledger).define("a", CONFIG, [("alpha", "/tasks/alpha")])
    async with ledger._engines.writer.begin() as conn:
        await conn.execute(text(
            "INSERT INTO job_queue (trial_id, job, task, k_index, task_dir, state) "
            "VALUES (:t, 'a', 'stolen', 0, '/tasks/stolen', 'queued')"),
            {"t": trial_id("b", "alpha", 0)})


def _riding_out(ledger: Ledger) -> JobRunner:
    """A job's runner, which rides out a store's blink for `RETRY_S`."""
    return JobRunner(ledger, "a", [], RunOptions(agent="nop", store_retry_s=RETRY_S))


@pytest.mark.anyio
async def test_a_constraint_violation_is_raised_at_once_naming_the_constraint(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        await _with_a_stolen_trial_id(ledger)
        define = functools.partial(Jobs(ledger).define, "b", CONFIG, [("alpha", "/t/alpha")])
        with anyio.fail_after(60):  # far less than RETRY_S: it was not ridden out
            with pytest.raises(IntegrityViolation) as raised:
                await _riding_out(ledger).riding_out(define)
        said = str(raised.value)
        assert not isinstance(raised.value, StoreUnavailable)
        assert "\n" not in said and "refused a write" in said, said
        # the constraint, in the database's own words
        assert ("UNIQUE constraint failed: job_queue.trial_id" in said
                if ledger.dialect == "sqlite" else '"job_queue_pkey"' in said), said
        assert [j["job"] for j in await Jobs(ledger).names()] == ["a"]  # nothing of b


@pytest.mark.anyio
async def test_a_sqlite_store_locked_by_another_writer_is_still_ridden_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = str(tmp_path / "t.db")
    monkeypatch.setenv("TRIALLEDGER_SQLITE_BUSY_MS", "50")  # locked past its wait at once
    async with await Ledger.open(db) as ledger:
        await Jobs(ledger).define("a", CONFIG, [("alpha", "/tasks/alpha")])
        other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")  # another process's write lock, held
        with pytest.raises(StoreUnavailable, match="locked"):
            await Jobs(ledger).claim("a", "r1", 60)
        threading.Timer(1.5, other.rollback).start()
        with anyio.fail_after(60):
            claim = await _riding_out(ledger).riding_out(
                functools.partial(Jobs(ledger).claim, "a", "r1", 60))
        other.close()
        assert claim is not None and claim.task == "alpha"


@pytest.mark.anyio
async def test_a_lease_holders_transaction_left_idle_is_ended_by_the_server(
        postgres: PostgresServer) -> None:
    """A lease holder paused inside a transaction (SIGSTOP, a VM frozen) would keep its
    locks for as long as it stays paused: the server ends such a transaction after two
    call deadlines, so other holders' claims go on. A store opened without a deadline (no
    lease) keeps PostgreSQL's default (none)."""
    from trialledger.store.engine import make_engines

    db = postgres.create_database()
    holder, plain = make_engines(db, call_timeout_s=1.0), make_engines(db)
    try:
        async with holder.writer.connect() as conn:
            shown = (await conn.execute(text("SHOW idle_in_transaction_session_timeout")))
            assert shown.scalar() == "2s"
            await conn.execute(text("SELECT 1"))  # the transaction opens, then idles
            deadline = time.monotonic() + 30
            ended = False
            while not ended and time.monotonic() < deadline:
                await anyio.sleep(0.5)
                async with plain.reader.connect() as other:
                    ended = not (await other.execute(text(
                        "SELECT count(*) FROM pg_stat_activity WHERE state = "
                        "'idle in transaction' AND datname = current_database()"))).scalar()
            assert ended, "the idle transaction was never ended"
            with pytest.raises(exc.DBAPIError):
                await conn.execute(text("SELECT 1"))
        async with plain.writer.connect() as conn:
            shown = (await conn.execute(text("SHOW idle_in_transaction_session_timeout")))
            assert shown.scalar() == "0"
    finally:
        await holder.dispose()
        await plain.dispose()


@pytest.mark.anyio
async def test_a_silent_server_costs_one_ping_not_one_per_pooled_connection(
        postgres: PostgresServer) -> None:
    """A lease holder's pool holds connections to a server that went silent (their backends
    SIGSTOPped: no reset, no answer): the first checkout's ping runs past its deadline and
    the pool drops every connection it held before, so the next calls connect anew at once
    instead of each waiting out a ping of its own (on a loaded machine, enough such waits in
    a row outlasted a held trial's retries and ended the `job run`)."""
    import os
    import signal

    from sqlalchemy import event

    from trialledger.store.engine import make_engines

    db = postgres.create_database()
    engines = make_engines(db, call_timeout_s=1.0)
    pinged_silent: list[BaseException | None] = []
    event.listen(engines.reader.sync_engine.pool, "invalidate",
                 lambda _conn, _record, error: pinged_silent.append(error))
    stopped: list[int] = []
    try:
        async with contextlib.AsyncExitStack() as stack:  # four pooled connections
            conns = [await stack.enter_async_context(engines.reader.connect())
                     for _ in range(4)]
            for conn in conns:
                stopped.append((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        await anyio.sleep(0.6)  # idle past PING_IDLE_S: each checkout pings
        started = time.monotonic()
        for _ in range(4):
            async with engines.reader.connect() as conn:
                pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
                assert pid not in stopped
        took = time.monotonic() - started
        assert len(pinged_silent) == 1, pinged_silent
        # one ping's deadline (1 s), the stale connections cut: a polite close waits 2 s
        # each for a goodbye a silent server never sends (≥ 9 s for these four)
        assert took < 3.0, took
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await engines.dispose()


@pytest.mark.anyio
async def test_a_stopped_postgresql_is_still_ridden_out(postgres: PostgresServer) -> None:
    db = postgres.create_database()
    data = str(postgres.folder / "data")

    def restart_later() -> None:
        time.sleep(2)
        postgres.start_again()

    async with await Ledger.open(db) as ledger:
        await Jobs(ledger).define("a", CONFIG, [("alpha", "/tasks/alpha")])
        postgres._run("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        starter = threading.Thread(target=restart_later)
        try:
            with pytest.raises(StoreUnavailable):
                await Jobs(ledger).claim("a", "r1", 60)
            starter.start()
            with anyio.fail_after(60):
                claim = await _riding_out(ledger).riding_out(
                    functools.partial(Jobs(ledger).claim, "a", "r1", 60))
        finally:
            if starter.ident is None:  # failed before the restart was asked for
                starter.start()
            starter.join(timeout=60)
        assert claim is not None and claim.task == "alpha"


class _DriverError(Exception):
    """A driver's error carrying PostgreSQL's SQLSTATE, as asyncpg's (through SQLAlchemy's
    adapter) does."""

    def __init__(self, message: str, sqlstate: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(("error", "kind"), [
    (exc.OperationalError("SELECT", {}, sqlite3.OperationalError("database is locked")),
     StoreUnavailable),
    (exc.OperationalError("SELECT", {}, sqlite3.OperationalError("disk I/O error")),
     StoreUnavailable),
    (exc.DatabaseError("SELECT", {}, sqlite3.DatabaseError("database disk image is "
                                                           "malformed")), StoreUnavailable),
    (exc.IntegrityError("INSERT", {}, sqlite3.IntegrityError("UNIQUE constraint failed: "
                                                             "jobs.name")), IntegrityViolation),
    (exc.ProgrammingError("SELEC", {}, sqlite3.ProgrammingError("syntax")), StatementRefused),
    (exc.DBAPIError("INSERT", {}, _DriverError("duplicate key", "23505")), IntegrityViolation),
    (exc.DBAPIError("SELECT", {}, _DriverError("invalid input syntax", "22P02")),
     StatementRefused),
    (exc.DBAPIError("SELECT", {}, _DriverError("terminating connection", "57P01")),
     StoreUnavailable),
    (exc.DBAPIError("SELECT", {}, _DriverError("could not write: No space left", "53100")),
     StoreUnavailable),
    (exc.DBAPIError("SELECT", {}, _DriverError("deadlock detected", "40P01")),
     StoreUnavailable),
    (exc.TimeoutError("QueuePool limit reached"), StoreUnavailable),
    (ConnectionRefusedError(111, "Connection refused"), StoreUnavailable),
    (exc.ArgumentError("not a column"), StatementRefused),
])
def test_each_driver_error_has_its_kind(error: BaseException, kind: type) -> None:
    found = store_error("postgresql://u:secret@db/x", error)
    assert type(found) is kind, found
    assert "secret" not in str(found) and "\n" not in str(found)
