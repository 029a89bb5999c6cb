"""`trialledger sql`: one read-only, time-limited query over the analyst views.

On SQLite the file is opened read-only, temporary storage is held in memory, and a
process-wide cap on SQLite's heap bounds that memory; a progress handler and a timer
stop the query at its deadline. On PostgreSQL the query runs on a connection of the
reader login itself — a plain role that holds no other, read-only by default, its temp
files capped on the role — so nothing the query says can take up another role's rights.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import ctypes.util
import functools
import hashlib
import hmac
import math
import os
import re
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import anyio
from sqlalchemy import URL, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.pool import NullPool

from trialledger.store.defaults import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, READER_ROLE
from trialledger.store.engine import database_url, open_engines, shown, sqlite_path
from trialledger.store.errors import QueryRefused as QueryRefused

RESULT_BUDGET = 64 * 2**20  # bytes of values one query may return
SQLITE_HEAP_LIMIT = 512 * 2**20  # bytes SQLite may hold in this process (temp storage too)
PROGRESS_OPS = 1_000  # SQLite virtual-machine steps between two looks at the deadline
# The PostgreSQL reader login's bounds, set on the role: work_mem per sort or hash;
# temp_file_limit on all of a session's temporary files (only a superuser may change it).
READER_SETTINGS = {"default_transaction_read_only": "on",
                   "statement_timeout": f"{DEFAULT_TIMEOUT_S:g}s",
                   "work_mem": "16MB", "temp_file_limit": "1GB"}


@dataclass(frozen=True)
class QueryResult:
    """Column names and rows of a query."""

    columns: list[str]
    rows: list[tuple[Any, ...]]

    def records(self) -> list[dict[str, Any]]:
        """The rows as objects keyed by column name."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


# What a read-only query may not do on SQLite, whatever the file's mode: ATTACH and VACUUM
# INTO create files, pragmas with a value change settings, and these functions reach out.
_DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer", "readfile", "writefile",
                               "edit"})
_DENIED_PRAGMAS = frozenset({"wal_checkpoint", "optimize", "incremental_vacuum",
                             "shrink_memory", "wal_autocheckpoint", "journal_mode"})


def _authorize(action: int, first: str | None, second: str | None, *_: object) -> int:
    if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA and (second is not None
                                            or (first or "").lower() in _DENIED_PRAGMAS):
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (second or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes) else 8


def _collect(fetch: Any, columns: list[str], budget: int) -> QueryResult:
    """Rows fetched in batches until the result passes `budget` bytes (then refused)."""
    rows: list[tuple[Any, ...]] = []
    used = 0
    while batch := fetch(500):
        for row in batch:
            used += sum(_size(v) for v in row)
            if used > budget:
                raise QueryRefused(f"the result passes {budget // 2**20} MiB; "
                                   "narrow it (LIMIT, fewer columns)")
            rows.append(tuple(row))
    return QueryResult(columns, rows)


@functools.cache
def _heap_limit() -> Callable[[int], int] | None:
    """SQLite's `sqlite3_hard_heap_limit64` (the library Python's sqlite3 uses), or None."""
    found = ctypes.util.find_library("sqlite3")
    if found is None:
        return None
    try:
        function = ctypes.CDLL(found).sqlite3_hard_heap_limit64
    except (OSError, AttributeError):
        return None
    function.restype, function.argtypes = ctypes.c_int64, [ctypes.c_int64]
    return cast(Callable[[int], int], function)


@contextlib.contextmanager
def _heap_capped() -> Iterator[None]:
    """SQLite's heap capped while a query runs. The cap is the whole process's and a
    pragma can only lower it, so it is set and given back through the C API: a service
    that embeds the store keeps its own connections uncapped."""
    limit = _heap_limit()
    before = limit(-1) if limit is not None else None
    try:
        yield
    finally:
        if limit is not None and before is not None:
            limit(before)


def _bound_sqlite(conn: sqlite3.Connection) -> None:
    """Settings the query's own pragmas may not change (the authorizer refuses a pragma
    with a value): temporary tables and sort spills in memory, never in a temp file, and
    SQLite's heap capped (given back after the query, `_heap_capped`)."""
    conn.execute("PRAGMA temp_store = MEMORY")
    conn.execute(f"PRAGMA hard_heap_limit = {SQLITE_HEAP_LIMIT}")
    conn.execute("PRAGMA query_only = ON")
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, RESULT_BUDGET)


def _sqlite_refusal(error: Exception, timeout_s: float) -> str:
    reason = str(error) or type(error).__name__
    if reason == "interrupted":
        return f"query ran past its {timeout_s:g} s limit"
    if isinstance(error, MemoryError) or reason == "out of memory":
        return (f"query needs more than {SQLITE_HEAP_LIMIT // 2**20} MiB of memory (its sorts "
                "and temporary tables included); narrow it")
    if reason.startswith("not authorized") or reason == "authorization denied":
        return ("not allowed in a read-only query (ATTACH, VACUUM INTO, PRAGMA writes "
                "and extension functions are refused)")
    return reason


def _interrupt(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.ProgrammingError):  # closed as the deadline passed
        conn.interrupt()


def _sqlite_query(path: str, sql: str, timeout_s: float) -> QueryResult:
    deadline = time.monotonic() + timeout_s
    if not os.path.isfile(path):
        raise QueryRefused(f"no database at {path}")
    conn = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True,
                           timeout=timeout_s)
    # The progress handler runs between steps; one step (a big value, a sort's merge) can
    # take long, so a timer also interrupts the statement at the deadline.
    alarm = threading.Timer(timeout_s, _interrupt, (conn,))
    try:
        with _heap_capped():
            return _run_bounded(conn, sql, deadline, alarm)
    except (sqlite3.Error, ValueError, OverflowError, MemoryError) as error:
        raise QueryRefused(_sqlite_refusal(error, timeout_s)) from None
    finally:
        alarm.cancel()
        conn.close()


def _run_bounded(conn: sqlite3.Connection, sql: str, deadline: float,
                 alarm: threading.Timer) -> QueryResult:
    """The query on `conn`, bounded (settings, authorizer, deadline) before it starts."""
    _bound_sqlite(conn)
    conn.set_authorizer(_authorize)
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_OPS)
    alarm.start()
    cursor = conn.execute(sql)
    columns = [d[0] for d in cursor.description or []]
    return _collect(cursor.fetchmany, columns, RESULT_BUDGET)


def reader_password(store_password: str, role: str = READER_ROLE) -> str:
    """The reader login's password, derived one way from the store's own: whoever holds
    the store's URL can sign in as the reader, and the reader's password tells nothing of
    the store's (a slow derivation, so a weak store password is no quick guess either)."""
    key = hashlib.pbkdf2_hmac("sha256", store_password.encode(),
                              f"trialledger reader login {role}".encode(), 200_000)
    return base64.urlsafe_b64encode(key).decode().rstrip("=")


def reader_url(db: str, role: str = READER_ROLE) -> URL:
    """The URL `sql` connects with on PostgreSQL: the reader login's own. A URL that names
    `role` as its user is taken as given; the store's URL gives the reader the password
    `reader_password` derives from its own (none, when it carries none: then pg_hba.conf
    must let the reader in by another method, such as peer or cert)."""
    url = database_url(db)
    if url.username == role:
        return url
    password = reader_password(url.password, role) if url.password else None
    return url.set(username=role, password=password)


def _scram_verifier(password: str) -> str:
    """What PostgreSQL stores for a SCRAM-SHA-256 password (RFC 5802, RFC 7677), computed
    here so the password itself never reaches the server's statement log."""
    salt, rounds = os.urandom(16), 4096
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, rounds)
    stored = hashlib.sha256(hmac.digest(salted, b"Client Key", "sha256")).digest()
    server = hmac.digest(salted, b"Server Key", "sha256")
    b64 = [base64.b64encode(part).decode() for part in (salt, stored, server)]
    return f"SCRAM-SHA-256${rounds}:{b64[0]}${b64[1]}:{b64[2]}"


_SIGN_IN_FIX = {  # why the reader could not connect → what the operator configures
    "pg_hba.conf": "allow it in pg_hba.conf (e.g. `host {database} {role} CLIENT/32 "
                   "scram-sha-256`) and reload the server",
    "": "create it, or reset its password, with `trialledger db upgrade --db STORE_URL "
        "--create-readonly-role{named}` (its password derives from the store URL's)",
}


def _sign_in_refusal(db: str, url: URL, role: str | None, error: Exception) -> QueryRefused:
    orig = getattr(error, "orig", None) or error
    reason = str(orig).splitlines()[0] if str(orig) else type(orig).__name__
    if role is None or getattr(orig, "sqlstate", None) not in ("28000", "28P01"):
        return QueryRefused(f"cannot connect to {shown(db)}: {reason}")
    fix = _SIGN_IN_FIX["pg_hba.conf" if "pg_hba.conf" in reason else ""]
    named = "" if role == READER_ROLE else f" {role}"
    return QueryRefused(f"the reader login {role} cannot connect ({reason}): "
                        + fix.format(database=url.database, role=role, named=named))


_LOGIN = text("""
    SELECT r.rolsuper OR r.rolcreaterole OR r.rolcreatedb OR r.rolreplication
           OR r.rolbypassrls,
           (SELECT string_agg(g.rolname, ', ' ORDER BY g.rolname) FROM pg_auth_members m
            JOIN pg_roles g ON g.oid = m.roleid WHERE m.member = r.oid),
           current_setting('default_transaction_read_only'),
           current_setting('temp_file_limit')
    FROM pg_roles r WHERE r.rolname = session_user""")


async def _check_reader(conn: AsyncConnection, role: str) -> None:
    """Refuse a login with rights beyond reading: one that is privileged or holds another
    role could take that role's rights (SET ROLE), one without its bounds is unbounded."""
    privileged, holds, read_only, temp_limit = (await conn.execute(_LOGIN)).one()
    redo = f"run `trialledger db upgrade --db STORE_URL --create-readonly-role {role}`"
    if privileged or holds:
        raise QueryRefused(f"the reader login {role} may do more than read ("
                           + (f"it holds {holds}" if holds else "it is privileged")
                           + "): `sql` runs only as a plain login that holds no other role")
    if read_only != "on":
        raise QueryRefused(f"the reader login {role} is not read-only by default: {redo}")
    if temp_limit == "-1":
        raise QueryRefused(
            f"the reader login {role} has no cap on temporary files: a superuser must run "
            f"ALTER ROLE {role} SET temp_file_limit = '{READER_SETTINGS['temp_file_limit']}'")


async def _postgres_query(db: str, sql: str, timeout_s: float, role: str | None
                          ) -> QueryResult:
    url = database_url(db) if role is None else reader_url(db, check_role_name(role))
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        try:
            conn = await engine.connect()
        except (DBAPIError, OSError) as error:
            raise _sign_in_refusal(db, url, role, error) from None
        try:
            conn = await conn.execution_options(postgresql_readonly=True)
            if role is not None:
                await _check_reader(conn, role)
            limit_ms = max(1, int(timeout_s * 1000))  # 0 would mean no limit
            await conn.execute(text(f"SET LOCAL statement_timeout = {limit_ms}"))
            result = await conn.exec_driver_sql(sql)
            if not result.returns_rows:
                return QueryResult([], [])
            return _collect(result.fetchmany, list(result.keys()), RESULT_BUDGET)
        finally:
            await conn.close()  # rolled back
    except DBAPIError as error:
        reason = str(error.orig).splitlines()[0] if error.orig else str(error)
        if "statement timeout" in reason:
            reason = f"query ran past its {timeout_s:g} s limit"
        raise QueryRefused(reason) from None
    finally:
        await engine.dispose()


async def run_query(db: str, sql: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                    role: str | None = READER_ROLE) -> QueryResult:
    """Run one read-only statement against a store; refuse writes, files, overlong queries
    and results over the byte or memory budget. On PostgreSQL it connects as the reader
    login `role` (`create_reader_role` makes it; `reader_url` says how it signs in; None:
    as the URL's own user, for the queries trialledger itself wrote)."""
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise QueryRefused(f"--timeout must be more than 0 and at most {MAX_TIMEOUT_S:g} s")
    path = sqlite_path(db)
    if path is not None:
        return await anyio.to_thread.run_sync(_sqlite_query, path, sql, timeout_s)
    return await _postgres_query(db, sql, timeout_s, role)


def check_role_name(name: str) -> str:
    """A role name we put into SQL: lowercase letters, digits and `_` only."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
        raise QueryRefused(f"role name {name!r}: use lowercase letters, digits and _")
    return name


async def create_reader_role(db: str, name: str = READER_ROLE) -> None:
    """The PostgreSQL reader login `sql` connects as: it can read every table and view of
    the store and nothing else. It holds no other role (so no SET ROLE leads anywhere), is
    read-only by default, and carries its bounds (`READER_SETTINGS`) on the role; its
    password derives from the store URL's (`reader_password`). Run again, it resets them."""
    role = check_role_name(name)
    url = database_url(db)
    if url.username == role:
        raise QueryRefused(f"create the reader login {role} with the store's own URL")
    password = reader_password(url.password, role) if url.password else None
    secret = f"'{_scram_verifier(password)}'" if password else "NULL"
    async with open_engines(db) as engines:
        if engines.dialect != "postgresql":
            raise QueryRefused("--create-readonly-role is for PostgreSQL (a SQLite `sql` "
                               "opens the file read-only)")
        async with engines.writer.begin() as conn:
            exists = (await conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"),
                                         {"r": role})).scalar()
            verb = "ALTER" if exists else "CREATE"
            # (the driver's own statement: a verifier holds `:`, no bind mark for text())
            await conn.exec_driver_sql(f'{verb} ROLE "{role}" LOGIN PASSWORD {secret}')
            for statement in (
                *(f'ALTER ROLE "{role}" SET {key} = \'{value}\''
                  for key, value in READER_SETTINGS.items() if key != "temp_file_limit"),
                f'GRANT USAGE ON SCHEMA public TO "{role}"',
                f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{role}"',
                f'ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO "{role}"',
            ):
                await conn.execute(text(statement))
            capped = await _cap_temp_files(conn, role)
    if not capped:
        raise QueryRefused(
            f"the reader login {role} is made, but only a superuser may cap its temporary "
            f"files: have one run ALTER ROLE {role} SET temp_file_limit = "
            f"'{READER_SETTINGS['temp_file_limit']}' (until then `sql` refuses)")


async def _cap_temp_files(conn: AsyncConnection, role: str) -> bool:
    """temp_file_limit on the role, if this user may set it (a superuser, or one granted
    SET on the parameter)."""
    try:
        async with conn.begin_nested():
            await conn.execute(text(f'ALTER ROLE "{role}" SET temp_file_limit = '
                                    f"'{READER_SETTINGS['temp_file_limit']}'"))
    except DBAPIError as error:
        if getattr(error.orig, "sqlstate", None) == "42501":  # insufficient privilege
            return False
        raise
    return True
