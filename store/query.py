"""`trialledger sql`: one read-only, time-limited query over the analyst views."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

import anyio
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from trialledger.core.errors import TrialLedgerError
from trialledger.store.engine import make_engines, sqlite_path

DEFAULT_TIMEOUT_S = 10.0


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


def _sqlite_query(path: str, sql: str, timeout_s: float) -> QueryResult:
    deadline = time.monotonic() + timeout_s
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
    try:
        conn.execute("PRAGMA query_only = ON")
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        cursor = conn.execute(sql)
        rows = cursor.fetchall()
        columns = [d[0] for d in cursor.description or []]
        return QueryResult(columns, [tuple(r) for r in rows])
    except sqlite3.OperationalError as error:
        if str(error) == "interrupted":
            raise QueryRefused(f"query ran past its {timeout_s:g} s limit") from None
        raise QueryRefused(str(error)) from None
    except sqlite3.Error as error:
        raise QueryRefused(str(error)) from None
    finally:
        conn.close()


async def _postgres_query(db: str, sql: str, timeout_s: float) -> QueryResult:
    engines = make_engines(db)
    try:
        async with engines.reader.connect() as conn:  # rolled back when it closes
            conn = await conn.execution_options(postgresql_readonly=True)
            await conn.execute(text(f"SET LOCAL statement_timeout = {int(timeout_s * 1000)}"))
            result = await conn.exec_driver_sql(sql)
            columns = list(result.keys())
            rows = [tuple(r) for r in result.all()] if result.returns_rows else []
            return QueryResult(columns, rows)
    except DBAPIError as error:
        reason = str(error.orig).splitlines()[0] if error.orig else str(error)
        if "statement timeout" in reason:
            reason = f"query ran past its {timeout_s:g} s limit"
        raise QueryRefused(reason) from None
    finally:
        await engines.dispose()


async def run_query(db: str, sql: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> QueryResult:
    """Run one read-only statement against a store; refuse writes and overlong queries."""
    engines = make_engines(db)
    path = sqlite_path(engines.url)
    await engines.dispose()
    if path is not None:
        return await anyio.to_thread.run_sync(_sqlite_query, path, sql, timeout_s)
    return await _postgres_query(db, sql, timeout_s)
