"""`trialledger sql`: one read-only, time-limited query over the analyst views."""

from __future__ import annotations

import math
import os
import re
import sqlite3
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import anyio
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from trialledger.core.errors import TrialLedgerError
from trialledger.store.defaults import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, READER_ROLE
from trialledger.store.engine import open_engines, sqlite_path

RESULT_BUDGET = 64 * 2**20  # bytes of values one query may return


class QueryRefused(TrialLedgerError):
    """A query that failed, wrote, or ran past its time limit."""


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


def _sqlite_query(path: str, sql: str, timeout_s: float) -> QueryResult:
    deadline = time.monotonic() + timeout_s
    if not os.path.isfile(path):
        raise QueryRefused(f"no database at {path}")
    conn = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True,
                           timeout=timeout_s)
    try:
        conn.execute("PRAGMA query_only = ON")
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, RESULT_BUDGET)
        conn.set_authorizer(_authorize)
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        cursor = conn.execute(sql)
        columns = [d[0] for d in cursor.description or []]
        return _collect(cursor.fetchmany, columns, RESULT_BUDGET)
    except (sqlite3.Error, ValueError, OverflowError, MemoryError) as error:
        reason = str(error) or type(error).__name__
        if reason == "interrupted":
            reason = f"query ran past its {timeout_s:g} s limit"
        elif reason.startswith("not authorized") or reason == "authorization denied":
            reason = ("not allowed in a read-only query (ATTACH, VACUUM INTO, PRAGMA writes "
                      "and extension functions are refused)")
        raise QueryRefused(reason) from None
    finally:
        conn.close()


async def _postgres_query(db: str, sql: str, timeout_s: float, role: str | None
                          ) -> QueryResult:
    try:
        async with open_engines(db) as engines, engines.reader.connect() as conn:
            # the connection is rolled back when it closes
            conn = await conn.execution_options(postgresql_readonly=True)
            if role is not None:  # the query runs with the reader role's rights only
                found = (await conn.execute(text(
                    "SELECT pg_has_role(current_user, oid, 'MEMBER') FROM pg_roles "
                    "WHERE rolname = :r"), {"r": role})).scalar()
                if not found:
                    raise QueryRefused(
                        f"no read-only role {role} to run the query as: create it with "
                        f"`trialledger db upgrade --db URL --create-readonly-role {role}` "
                        "(and let analysts connect as it)")
                await conn.execute(text(f'SET LOCAL ROLE "{check_role_name(role)}"'))
            limit_ms = max(1, int(timeout_s * 1000))  # 0 would mean no limit
            await conn.execute(text(f"SET LOCAL statement_timeout = {limit_ms}"))
            result = await conn.exec_driver_sql(sql)
            if not result.returns_rows:
                return QueryResult([], [])
            return _collect(result.fetchmany, list(result.keys()), RESULT_BUDGET)
    except DBAPIError as error:
        reason = str(error.orig).splitlines()[0] if error.orig else str(error)
        if "statement timeout" in reason:
            reason = f"query ran past its {timeout_s:g} s limit"
        raise QueryRefused(reason) from None


async def run_query(db: str, sql: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                    role: str | None = READER_ROLE) -> QueryResult:
    """Run one read-only statement against a store; refuse writes, files, overlong queries
    and results over the byte budget. On PostgreSQL it runs as `role` (a read-only role
    `create_reader_role` made; None: as the connecting user, for trusted queries)."""
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
    """A PostgreSQL role that can read every table and view of the store and nothing else
    (no writes, no functions of other roles' backends, no server programs); the
    connecting user becomes a member, so `sql` can run as it."""
    role = check_role_name(name)
    async with open_engines(db) as engines:
        if engines.dialect != "postgresql":
            raise QueryRefused("--create-readonly-role is for PostgreSQL (a SQLite `sql` "
                               "opens the file read-only)")
        async with engines.writer.begin() as conn:
            exists = (await conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"),
                                         {"r": role})).scalar()
            if not exists:
                await conn.execute(text(f'CREATE ROLE "{role}" NOLOGIN NOINHERIT'))
            for statement in (
                f'GRANT USAGE ON SCHEMA public TO "{role}"',
                f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{role}"',
                f'ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO "{role}"',
                f'GRANT "{role}" TO CURRENT_USER',
            ):
                await conn.execute(text(statement))
