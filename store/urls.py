"""What a `--db` names (SPEC §10): its SQLAlchemy URL, the file behind it, and the form
messages show it in (any password masked) — apart from the engines, so that the store's
errors can name a store without importing them."""

from __future__ import annotations

import os

from sqlalchemy import URL, make_url
from sqlalchemy.exc import ArgumentError

from trialledger.core.errors import TrialLedgerError


class UnsupportedDatabase(TrialLedgerError):
    """A `--db` that names neither a SQLite file nor a PostgreSQL server."""


def database_url(db: str) -> URL:
    """The SQLAlchemy async URL for `--db`: a file path, `sqlite:///PATH` or
    `postgresql://…` (asyncpg). A path may hold `?`, `#` or `%` (it is never parsed)."""
    if "://" not in db:
        return URL.create("sqlite+aiosqlite", database=os.path.abspath(db))
    scheme = db.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme not in ("sqlite", "postgresql", "postgres"):
        raise UnsupportedDatabase(f"--db {scheme}://… is not supported: give a file path, "
                                  "sqlite:///PATH or postgresql://USER@HOST/DB")
    try:
        url = make_url(db)
    except ArgumentError:
        raise UnsupportedDatabase(f"--db {shown(db)}: not a database URL") from None
    return url.set(drivername="sqlite+aiosqlite" if scheme == "sqlite"
                   else "postgresql+asyncpg")


def shown(db: str, text: str | None = None) -> str:
    """`db` (or `text` that may quote it) with the URL's password masked, for messages."""
    if "://" not in db:
        return db if text is None else text
    try:
        url = make_url(db)
    except ArgumentError:
        return "(an unparsable database URL)" if text is None else text
    masked = url.render_as_string(hide_password=True)
    if text is None:
        return masked
    return text.replace(url.password, "***") if url.password else text


def sqlite_path(db: str) -> str | None:
    """The file behind a `--db` (None for PostgreSQL)."""
    url = database_url(db)
    return url.database if url.get_backend_name() == "sqlite" else None
