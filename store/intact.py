"""A quick look at a SQLite store before `ls`, `import` or `show` use it: its header and
its schema must be a trialledger store's. Pages beyond the schema are not read here — a
full check of every page is `audit`'s (it reads the whole file).

>>> check_store_file("trials.db")                            # doctest: +SKIP
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path

from trialledger.core.errors import TrialLedgerError
from trialledger.store.engine import sqlite_path
from trialledger.store.log import EVENT_COLUMNS

MAGIC = b"SQLite format 3\x00"
# Tables every revision of the store has had since its first (their columns are checked
# where a command reads them by name).
TABLES = ("alembic_version", "events", "sessions")


class StoreDamaged(TrialLedgerError):
    """A file that is not a trialledger store, or whose SQLite header or schema is
    damaged: refused in one line that names `audit`."""


def check_store_file(db: str) -> None:
    """Raise `StoreDamaged` unless the SQLite file behind `db` (if any: PostgreSQL, a new
    or empty file pass) has a sound header and a trialledger schema."""
    path = sqlite_path(db)
    if not path or path == ":memory:" or not os.path.isfile(path):
        return
    with open(path, "rb") as handle:
        header = handle.read(100)
    if not header:
        return  # an empty file: SQLite makes a new database in it
    fault = _header_fault(header, os.path.getsize(path)) or _schema_fault(Path(path))
    if fault is not None:
        raise StoreDamaged(f"{path} {fault}: refused (`trialledger audit --db {path}` "
                           "checks the whole file)")


def _header_fault(header: bytes, size: int) -> str | None:
    """What is wrong with a database header (SQLite's file format, section 1.3)."""
    if len(header) < 100 or not header.startswith(MAGIC):
        return "is not a SQLite database (no SQLite header)"
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or page_size & (page_size - 1):
        return f"has a damaged SQLite header (page size {page_size})"
    if header[18] not in (1, 2) or header[19] not in (1, 2):
        return "has a damaged SQLite header (file format versions)"
    if header[21:24] != b"\x40\x20\x20":
        return "has a damaged SQLite header (payload fractions)"
    if int.from_bytes(header[44:48], "big") not in (1, 2, 3, 4):
        return "has a damaged SQLite header (schema format)"
    if int.from_bytes(header[56:60], "big") not in (1, 2, 3):
        return "has a damaged SQLite header (text encoding)"
    if size % page_size:
        return f"has a damaged SQLite header (the file is not whole {page_size}-byte pages)"
    return None


def _schema_fault(path: Path) -> str | None:
    """What is wrong with the schema: its b-tree, its text, or trialledger's tables."""
    try:
        with closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True,
                                     timeout=30)) as conn:
            checked = [row[0] for row in conn.execute("PRAGMA quick_check(sqlite_schema)")]
            if checked != ["ok"]:
                return f"has a damaged schema ({'; '.join(map(str, checked[:2]))})"
            tables = {name for (name,) in conn.execute(
                "SELECT name FROM sqlite_schema WHERE type = 'table'")}
            if tables and (missing := [t for t in TABLES if t not in tables]):
                return f"is not a trialledger store (no table {', '.join(missing)})"
            columns = {row[1] for row in conn.execute("PRAGMA table_info(events)")}
    except sqlite3.DatabaseError as error:
        what = str(error).splitlines()[0] if str(error) else type(error).__name__
        if "locked" in what or "unable to open" in what:
            return None  # not damage: opening the store says what it is
        return f"has a damaged header or schema ({what})"
    if columns and (missing := [c for c in EVENT_COLUMNS if c not in columns]):
        return f"has a damaged schema (events has no column {', '.join(missing)})"
    return None
