"""The `events` table as the store's code sees it, and the statements its writer and
readers run on it that SQLAlchemy's expression layer would not build as fast (or at all)."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Column, Integer, MetaData, Table, Text

from trialledger.store.engine import POSITION_SEQUENCE
from trialledger.store.projections import SESSION_CHANGES

EVENT_COLUMNS = ("position", "session_id", "seq", "event_id", "type", "at", "recorded_at",
                 "schema", "data", "hash")
# A full Table (not a bare `table()`): RETURNING rows in parameter order needs its key.
EVENTS = Table(
    "events", MetaData(),
    Column("position", Integer, primary_key=True, autoincrement=True),
    *(Column(name, Integer if name in ("seq", "schema") else Text)
      for name in EVENT_COLUMNS[1:]),
)

# The most events appended by others since a writer last looked that its catch-up lists
# under the writers' lock (the list's memory and the time it holds the lock grow with it);
# past it the writer forgets its whole cache instead. Well above a commit of a big
# import (500 logs: 52k events), which must stay listed: past the bound every batch that
# gives ids is folded twice.
CATCH_UP_ROWS = 200_000
# SQLite: the session and id of every event appended after ?. Not `SELECT DISTINCT`:
# SQLite answers that by scanning the whole (session_id, seq) index, the length of the log
# on every commit; this reads only the rows after the position.
MOVED_SINCE_SQLITE = "SELECT session_id, event_id FROM events WHERE position > ?"
# PostgreSQL: the log's end, and the sessions and event ids of at most $3 events appended
# after $1, in one snapshot; and the position sequence moved past the $2 positions about
# to be given (a sequence ahead of the log is harmless: positions are given from the
# log's end).
CATCH_UP_PG = ("SELECT end_, moved.sessions, moved.ids, "
               f"setval({POSITION_SEQUENCE}, GREATEST(end_ + $2, 1)) "
               "FROM (SELECT COALESCE(max(position), 0) AS end_ FROM events) AS log, "
               "(SELECT array_agg(DISTINCT session_id) AS sessions, array_agg(event_id) AS ids "
               "FROM events WHERE position > $1 AND position <= $1 + $3) AS moved")
# PostgreSQL: a commit's events and its `sessions` updates in one statement, each column
# one array parameter (under the writers' lock every round trip holds the others up).
_PG_ARRAYS = {"position": "bigint[]", "seq": "int[]", "schema": "int[]", "head_seq": "int[]"}


def _unnest(columns: tuple[str, ...], first: int) -> str:
    arrays = (f"${n}::{_PG_ARRAYS.get(c, 'text[]')}" for n, c in enumerate(columns, first))
    return f"unnest({', '.join(arrays)})"


EVENTS_AND_SESSIONS_PG = (
    f"WITH inserted AS (INSERT INTO events ({', '.join(EVENT_COLUMNS)}) "
    f"SELECT * FROM {_unnest(EVENT_COLUMNS, 1)}) "
    f"UPDATE sessions AS s SET {', '.join(f'{c} = u.{c}' for c in SESSION_CHANGES[1:])} "
    f"FROM {_unnest(SESSION_CHANGES, len(EVENT_COLUMNS) + 1)} "
    f"AS u({', '.join(SESSION_CHANGES)}) WHERE s.session_id = u.session_id")


def columns(rows: list[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows as `width` column lists (empty lists for no rows)."""
    return [[row[i] for row in rows] for i in range(width)]


T = TypeVar("T")
IN_LIMIT = 900  # values per `IN (…)`: below 999, the least any SQLite build allows


def in_slices(values: list[T]) -> list[list[T]]:
    """`values` in parts small enough for one `IN (…)` each (a batch of thousands of
    concurrent imports names more ids than one statement may hold)."""
    return [values[i:i + IN_LIMIT] for i in range(0, len(values), IN_LIMIT)]
