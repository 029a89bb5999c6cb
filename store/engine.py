"""Database URLs and engines: the embedded SQLite default and PostgreSQL (asyncpg).

SQLite runs in WAL mode with `synchronous=FULL` by default: an acknowledged append
survives power loss. `synchronous=NORMAL` is faster (no fsync per commit, only at
checkpoints) but the last commits before a power cut may be lost (never corrupted);
choose it with `Ledger.open(..., sqlite_synchronous="NORMAL")`. Writers take the write
lock at `BEGIN IMMEDIATE`, so a transaction never fails half-way for want of it; the
appends' writer prepares its batch in a read transaction before that
(`prepared_transaction`).

On PostgreSQL every write transaction takes one advisory lock before it numbers
positions and holds it to its commit, so transactions commit in the order of the
positions they were given: a reader tailing by position can never skip an event that
commits later with a smaller position. (The appends' writer folds and hashes its batch
before taking it, and checks under it that nothing it folded moved meanwhile.)
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import anyio
from sqlalchemy import URL, Connection, Engine, create_engine, event, text
from sqlalchemy.exc import DisconnectionError, InvalidatePoolError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.util import await_

from trialledger.store.urls import UnsupportedDatabase as UnsupportedDatabase
from trialledger.store.urls import database_url as database_url
from trialledger.store.urls import shown as shown
from trialledger.store.urls import sqlite_path as sqlite_path

WRITER_LOCK_KEY = 7_402_145_391  # pg_advisory_xact_lock key shared by every writer
BUSY_TIMEOUT_MS = 30_000  # how long a SQLite statement waits for another's write lock
PING_IDLE_S = 0.5  # a pooled PostgreSQL connection idle this long is pinged at checkout
BUSY_ENV = "TRIALLEDGER_SQLITE_BUSY_MS"  # overrides it (after it, appends retry: recorder.py)
Synchronous = Literal["FULL", "NORMAL", "EXTRA", "OFF"]
T = TypeVar("T")
P = TypeVar("P")
POSITION_SEQUENCE = "pg_get_serial_sequence('events', 'position')"  # PostgreSQL's default
CALL_FLOOR_S = 2.0  # the shortest deadline a PostgreSQL call is given (`call_deadline`)
CALL_CEILING_S = 60.0  # and the longest a lease holder's calls are given
IDLE_IN_TRANSACTION_CALLS = 2  # a holder's transaction left idle this many call deadlines ends


def driver_marks(dialect: str, count: int) -> list[str]:
    """`count` parameter marks in the driver's own style (`$1`… for asyncpg, `?` for
    sqlite3), for `exec_driver_sql`."""
    return [f"${i}" if dialect == "postgresql" else "?" for i in range(1, count + 1)]


@dataclass(frozen=True)
class Engines:
    """One engine for the single writer and one for readers; on SQLite also a synchronous
    one that `transaction` runs whole write transactions on."""

    writer: AsyncEngine
    reader: AsyncEngine
    url: str
    sync_writer: Engine | None = None
    sync_reader: Engine | None = None
    writing: InUse = field(default_factory=lambda: InUse())  # the writer's connections out

    def __post_init__(self) -> None:
        if self.sync_writer is not None:  # SQLite: a statement is interrupted, then rolled back
            self.writing.watch(self.sync_writer, lambda dbapi: dbapi.interrupt())
        else:  # asyncpg: the socket is closed at once (the server rolls the transaction back)
            self.writing.watch(self.writer.sync_engine,
                               lambda dbapi: dbapi.driver_connection.terminate())

    def abandon_writes(self) -> int:
        """Cut every write connection in use (a stalled append's): its statement fails at
        once and its transaction is rolled back. Returns how many were cut."""
        return self.writing.cut_all()

    @property
    def dialect(self) -> str:
        """`sqlite` or `postgresql`."""
        return self.writer.dialect.name

    async def transaction(self, work: Callable[[Connection], T], *,
                          serialize: bool = False) -> T:
        """`work(conn)` inside one write transaction, committed when it returns.

        Every statement through the async SQLite driver crosses to its thread and back
        three or four times, each crossing costing CPU; here a whole transaction crosses
        once: it runs in a worker thread on a synchronous connection.
        On PostgreSQL `work` runs on the async connection through SQLAlchemy's greenlet
        bridge. `serialize`: first take the writers' lock (`lock_writers`)."""
        if self.sync_writer is not None:
            return await anyio.to_thread.run_sync(_in_thread, self.sync_writer, work)
        async with self.writer.begin() as conn:
            return await conn.run_sync(self._locked if serialize else _call, work)

    async def prepared_transaction(self, prepare: Callable[[Connection], P],
                                   work: Callable[[Connection, P], T]) -> T:
        """`work(conn, prepare(conn))` committed, with the writers' lock held only for `work`.

        `prepare` reads a snapshot of the store and does everything that need not be
        serialized; `work` runs under the writers' lock and must check that what
        `prepare` read still holds. On SQLite `prepare` runs in a read transaction of its
        own (WAL: beside another process's write) and `work` in a `BEGIN IMMEDIATE`
        transaction, both in one crossing to a worker thread; on PostgreSQL both run in
        one transaction, which takes the advisory lock between them."""
        if self.sync_writer is not None:
            return await anyio.to_thread.run_sync(self._two_phases, prepare, work)
        async with self.writer.begin() as conn:
            return await conn.run_sync(self._prepared_locked, prepare, work)

    def _two_phases(self, prepare: Callable[[Connection], P],
                    work: Callable[[Connection, P], T]) -> T:
        assert self.sync_reader is not None and self.sync_writer is not None
        with self.sync_reader.begin() as conn:
            prepared = prepare(conn)
        with self.sync_writer.begin() as conn:
            return work(conn, prepared)

    def _prepared_locked(self, conn: Connection, prepare: Callable[[Connection], P],
                         work: Callable[[Connection, P], T]) -> T:
        prepared = prepare(conn)
        self.lock_writers(conn)
        return work(conn, prepared)

    async def read(self, work: Callable[[Connection], T]) -> T:
        """`work(conn)` inside one read transaction (one crossing on SQLite, as above)."""
        if self.sync_reader is not None:
            return await anyio.to_thread.run_sync(_in_thread, self.sync_reader, work)
        async with self.reader.begin() as conn:
            return await conn.run_sync(_call, work)

    def _locked(self, conn: Connection, work: Callable[[Connection], T]) -> T:
        self.lock_writers(conn)
        return work(conn)

    def lock_writers(self, conn: Connection) -> None:
        """Serialize write transactions across processes (SQLite did at BEGIN IMMEDIATE)."""
        if self.dialect == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": WRITER_LOCK_KEY})

    def driver_sql(self, table: str, columns: tuple[str, ...]) -> str:
        """An INSERT in the driver's own parameter style, for `exec_driver_sql` executemany
        (it skips SQLAlchemy's per-row parameter processing on the hot path)."""
        marks = driver_marks(self.dialect, len(columns))
        return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(marks)})"

    def positions_taken(self, conn: Connection, last: int) -> None:
        """Keep PostgreSQL's position sequence past the positions the writer gave."""
        if self.dialect == "postgresql":
            conn.execute(
                text(f"SELECT setval({POSITION_SEQUENCE}, :last)"),
                {"last": last})

    async def dispose(self) -> None:
        """Close every pooled connection."""
        await self.writer.dispose()
        await self.reader.dispose()
        for engine in (self.sync_writer, self.sync_reader):
            if engine is not None:
                engine.dispose()


class InUse:
    """The connections an engine has checked out, each with how to cut it: a stalled one
    is abandoned (SPEC §8, capture never waits on the store), never waited for."""

    def __init__(self) -> None:
        self._cut: dict[int, Callable[[], None]] = {}

    def watch(self, engine: Engine, cut: Callable[[Any], None]) -> None:
        """Follow `engine`'s pool (listened to before any ping at checkout, so a ping that
        hangs can be cut too)."""

        @event.listens_for(engine.pool, "checkout", insert=True)
        def _out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
            self._cut[id(record)] = lambda: cut(dbapi_connection)

        @event.listens_for(engine.pool, "checkin")
        def _in(_dbapi_connection: Any, record: Any) -> None:
            self._cut.pop(id(record), None)

    def cut_all(self) -> int:
        """Cut every connection out now (one already gone is skipped)."""
        cuts = list(self._cut.values())
        for cut in cuts:
            with contextlib.suppress(Exception):
                cut()
        return len(cuts)


def _call(conn: Connection, work: Callable[[Connection], T]) -> T:
    return work(conn)


def _in_thread(engine: Engine, work: Callable[[Connection], T]) -> T:
    with engine.begin() as conn:  # the engine's own BEGIN (IMMEDIATE: the write lock)
        return work(conn)


def busy_timeout_ms() -> int:
    """SQLite's busy timeout: `TRIALLEDGER_SQLITE_BUSY_MS`, else 30 s."""
    raw = os.environ.get(BUSY_ENV)
    if raw is None:
        return BUSY_TIMEOUT_MS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UnsupportedDatabase(f"{BUSY_ENV} must be a whole number of milliseconds, not "
                                  f"{raw!r}")
    return value


def _sqlite_engine(url: URL, *, begin: str, synchronous: Synchronous) -> AsyncEngine:
    engine = create_async_engine(url, connect_args={"timeout": busy_timeout_ms() / 1000})
    _sqlite_setup(engine.sync_engine, begin=begin, synchronous=synchronous)
    return engine


def _sqlite_sync_engine(url: URL, *, begin: str, synchronous: Synchronous) -> Engine:
    """pysqlite on the same file, each connection used by one worker thread at a time
    (`Engines.transaction`, `Engines.read`)."""
    engine = create_engine(url.set(drivername="sqlite"), connect_args={
        "timeout": busy_timeout_ms() / 1000, "check_same_thread": False})
    _sqlite_setup(engine, begin=begin, synchronous=synchronous)
    return engine


def _sqlite_setup(engine: Engine, *, begin: str, synchronous: Synchronous) -> None:
    busy_ms = busy_timeout_ms()

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
        cursor = dbapi_connection.cursor()
        for pragma in (
            "journal_mode=WAL",
            f"synchronous={synchronous}",
            f"busy_timeout={busy_ms}",
            "foreign_keys=ON",
        ):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql(begin)


def _create_private(path: str | None) -> None:
    """A new SQLite file is created 0600 (its -wal and -shm files follow its mode)."""
    if path is None or path == ":memory:" or os.path.exists(path):
        return
    with contextlib.suppress(FileExistsError, FileNotFoundError):  # raced, or no folder
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))


@contextlib.asynccontextmanager
async def open_engines(db: str, *, sqlite_synchronous: Synchronous = "FULL"
                       ) -> AsyncIterator[Engines]:
    """`make_engines`, disposed of when the block ends."""
    engines = make_engines(db, sqlite_synchronous=sqlite_synchronous)
    try:
        yield engines
    finally:
        await engines.dispose()


def call_deadline(lease_s: float) -> float:
    """The deadline of each PostgreSQL call of a lease holder (`job run`, `worker`): a third
    of its lease, within [`CALL_FLOOR_S`, `CALL_CEILING_S`]. A call that does not answer by
    then fails as an outage and its connection is cut, so a holder never waits on a server
    that went silent (stopped, restarted behind a proxy, a peer gone without a reset) past
    its lease: its trial stops, its session folders are released and it claims again."""
    return max(CALL_FLOOR_S, min(CALL_CEILING_S, lease_s / 3))


def make_engines(db: str, *, sqlite_synchronous: Synchronous = "FULL",
                 call_timeout_s: float | None = None) -> Engines:
    """Engines for a `--db` value; `call_timeout_s`: PostgreSQL's deadline for each
    connect, checkout and statement (None: none)."""
    url = database_url(db)
    if url.get_backend_name() == "sqlite":
        _create_private(url.database)
        return Engines(
            writer=_sqlite_engine(url, begin="BEGIN IMMEDIATE", synchronous=sqlite_synchronous),
            reader=_sqlite_engine(url, begin="BEGIN", synchronous=sqlite_synchronous),
            url=url.render_as_string(hide_password=True),
            sync_writer=_sqlite_sync_engine(url, begin="BEGIN IMMEDIATE",
                                            synchronous=sqlite_synchronous),
            sync_reader=_sqlite_sync_engine(url, begin="BEGIN", synchronous=sqlite_synchronous),
        )
    return Engines(writer=_postgres_engine(url, pool_size=2, call_timeout_s=call_timeout_s),
                   reader=_postgres_engine(url, pool_size=4, call_timeout_s=call_timeout_s),
                   url=url.render_as_string(hide_password=True))


def _postgres_engine(url: URL, *, pool_size: int,
                     call_timeout_s: float | None = None) -> AsyncEngine:
    """An asyncpg engine whose pooled connections are checked when checked out, so one that
    died with a server restart is replaced, not used — what `pool_pre_ping` does, cheaper:
    a connection the driver knows is closed is dropped at once; one idle for `PING_IDLE_S`
    or more is pinged with one round trip (`pool_pre_ping` takes three for asyncpg, wrapping
    its ping in BEGIN and ROLLBACK); one checked in more recently is used as it is — a claim
    loop takes a connection every millisecond or two, and a ping each time was half its round
    trips. A connection that dies inside that window fails its statement as an outage
    (`StoreUnavailable`), which callers retry.

    `call_timeout_s`: a connect, a wait for a pooled connection and each statement (the
    ping too) not done by then raises `TimeoutError` (an outage, `StoreUnavailable`), and
    the connection is cut and dropped from the pool, never used again half-answered. The
    server, too, ends a transaction such a holder leaves idle for twice that
    (`idle_in_transaction_session_timeout`): a holder paused or cut off inside one would
    otherwise keep its row and advisory locks, and every other holder's claim waiting on
    them, until TCP noticed."""
    silent_since = [0.0]  # (wall clock) when a call last found the server silent or gone
    if call_timeout_s is None:
        engine = create_async_engine(url, pool_size=pool_size)
    else:
        idle_ms = str(round(IDLE_IN_TRANSACTION_CALLS * call_timeout_s * 1000))
        engine = create_async_engine(
            url, pool_size=pool_size, pool_timeout=call_timeout_s,
            connect_args={"timeout": call_timeout_s, "command_timeout": call_timeout_s,
                          "server_settings": {"idle_in_transaction_session_timeout":
                                              idle_ms}})

        @event.listens_for(engine.sync_engine, "handle_error")
        def _timed_out(context: Any) -> None:
            if isinstance(context.original_exception, TimeoutError):
                context.is_disconnect = True  # cut (terminated), never checked in again
                silent_since[0] = time.time()  # (and the pool before it: see `_cut`)

    @event.listens_for(engine.sync_engine.pool, "checkin")
    def _used(_dbapi_connection: Any, record: Any) -> None:
        record.info["checked_in"] = time.monotonic()

    @event.listens_for(engine.sync_engine.pool, "checkout")
    def _ping(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        driver = dbapi_connection.driver_connection
        if driver.is_closed():
            raise DisconnectionError("a pooled connection is closed")
        checked_in = record.info.get("checked_in")  # (none: connected for this checkout)
        if checked_in is None or time.monotonic() - checked_in < PING_IDLE_S:
            return
        try:
            await_(driver.fetchrow(";"))
        except Exception as error:  # gone: the pool discards it and connects anew —
            # and every connection pooled before it (a server that went silent or restarted
            # took them too: each would cost its own ping, a deadline each when silent)
            silent_since[0] = time.time()
            raise InvalidatePoolError(f"a pooled connection is gone: {error}") from error

    @event.listens_for(engine.sync_engine.pool, "close")
    def _cut(dbapi_connection: Any, record: Any) -> None:
        """A connection made before the server was last found silent is cut, not closed
        politely: SQLAlchemy's close of a dropped connection waits up to 2 s for the
        server's goodbye, which a silent server never sends — each stale connection
        would cost that on its way out."""
        if record is not None and record.starttime <= silent_since[0]:
            dbapi_connection.driver_connection.terminate()

    return engine
