"""A SQLite store a refused command made is removed again (docs/SPEC.md §10: a refused
command creates no database file).

A command that may create its store opens it inside `removed_if_unused`: when the command
fails and the file did not exist before it, the file (and its -wal, -shm and -journal) is
removed, but only while no table of it holds a row — a store that took any record is
never removed.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import urllib.parse
from collections.abc import Iterator

from trialledger.store.engine import sqlite_path

COMPANIONS = ("", "-wal", "-shm", "-journal")
SCHEMA_ONLY = ("alembic_version",)  # the tables every new store fills


@contextlib.contextmanager
def removed_if_unused(db: str) -> Iterator[None]:
    """Run the body; if it raises and made the SQLite file at `db`, remove that file while
    it holds no record."""
    path = sqlite_path(db)
    made = path is not None and path != ":memory:" and not any(
        os.path.lexists(path + suffix) for suffix in COMPANIONS)
    try:
        yield
    except BaseException:
        if made and path is not None and _unused(path):
            for suffix in COMPANIONS:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path + suffix)
        raise


def _unused(path: str) -> bool:
    """Whether the store at `path` holds no row outside the schema's own tables."""
    try:
        with contextlib.closing(sqlite3.connect(
                f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro", uri=True)) as conn:
            tables = [name for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' "
                "AND name NOT LIKE 'sqlite_%'") if name not in SCHEMA_ONLY]
            return not any(conn.execute(f'SELECT 1 FROM "{name}" LIMIT 1').fetchone()
                           for name in tables)
    except sqlite3.Error:  # unreadable: not ours to judge, so kept
        return False
