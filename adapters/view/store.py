"""The store as `trialledger view` reads it: opened read-only, and the few queries its
pages need beyond the `Ledger` and `Jobs` methods (docs/SPEC.md §10, "view").

SQLite: `create=False` (a missing file is refused, never made) and every connection
`PRAGMA query_only`, so no statement can write. PostgreSQL: the reader login `sql` uses
(`store.query.reader_url`), which is read-only by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from trialledger.store import Ledger
from trialledger.store.engine import sqlite_path
from trialledger.store.query import reader_url


async def open_read_only(db: str) -> Ledger:
    """The store at `db`, opened so that nothing through it can write."""
    if sqlite_path(db) is None:
        url = reader_url(db).render_as_string(hide_password=False)
        return await Ledger.open(url, create=False)
    ledger = await Ledger.open(db, create=False)
    engines = ledger._engines  # the view's own guard on the connections the Ledger opens
    for engine in (engines.writer.sync_engine, engines.reader.sync_engine,
                   engines.sync_writer, engines.sync_reader):
        if engine is not None:
            _query_only(engine)
    await engines.writer.dispose()  # the one connection opened before the guard
    await engines.reader.dispose()
    return ledger


def _query_only(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA query_only = ON")
        cursor.close()


async def rows(ledger: Ledger, sql: str, params: Mapping[str, Any] | None = None
               ) -> list[dict[str, Any]]:
    """The rows of one read query, as dicts."""
    async with ledger._engines.reader.begin() as conn:
        result = await conn.execute(text(sql), dict(params or {}))
        keys = list(result.keys())  # once: a row's `_mapping` builds its keys again
        return [dict(zip(keys, r, strict=True)) for r in result]
