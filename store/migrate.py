"""The migration runner: alembic revisions applied on the store's own connection."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from trialledger import migrations
from trialledger.store.engine import open_engines, shown
from trialledger.store.errors import SchemaOutOfDate as SchemaOutOfDate  # defined here before
from trialledger.store.errors import store_error
from trialledger.store.query import create_reader_role

if TYPE_CHECKING:  # alembic is imported where a migration runs: opening a current store
    # (every run's start) reads the revision with one query and never pays its import
    from alembic.config import Config

SCRIPT_LOCATION = str(Path(migrations.__file__).resolve().parent)


def alembic_config() -> Config:
    """The alembic configuration for trialledger's revisions."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    return config


def head_revision() -> str:
    """The newest revision the code knows: the highest-numbered file of
    migrations/versions (a revision's id is its file's number; tests/store/test_migrations.py
    checks that this is alembic's head)."""
    return max(path.name.split("_", 1)[0]
               for path in (Path(SCRIPT_LOCATION) / "versions").glob("[0-9]*_*.py"))


def revisions() -> list[str]:
    """Every revision, oldest first (alembic's walk)."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config())
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


def _current(connection: Connection) -> str | None:
    """The revision alembic recorded (its `alembic_version` table), None when none."""
    if "alembic_version" not in inspect(connection).get_table_names():
        return None
    rows = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    return str(rows[0]) if len(rows) == 1 else None


def _has_tables(connection: Connection) -> bool:
    return bool(inspect(connection).get_table_names())


async def current_revision(engine: AsyncEngine) -> str | None:
    """The revision a database is at (None when it has none)."""
    async with engine.connect() as conn:
        return await conn.run_sync(_current)


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Build or migrate a database to `revision`."""
    from alembic import command

    await _run(engine, lambda config: command.upgrade(config, revision))


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    """Migrate a database down to `revision` (`base` removes everything)."""
    from alembic import command

    await _run(engine, lambda config: command.downgrade(config, revision))


# alembic runs a revision through its process-global `context`: two migrations at once in
# one process (two stores opened together) would apply one's operations on the other's
# connection. One at a time per event loop, and across threads.
_loop_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary())
_thread_lock = threading.Lock()


async def _run(engine: AsyncEngine, step: Callable[[Config], None],
               then: Callable[[Connection], None] | None = None) -> None:
    """`step` on a connection of `engine`, in one transaction (`then` after it, in it)."""
    def in_sync(connection: Connection) -> None:
        config = alembic_config()
        config.attributes["connection"] = connection
        with _thread_lock:
            step(config)
        if then is not None:
            then(connection)

    lock = _loop_locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
    async with lock, engine.begin() as conn:
        await conn.run_sync(in_sync)


async def ensure_current(engine: AsyncEngine, *, db: str) -> None:
    """Build an empty database; refuse one at another revision, naming the command to run."""
    async with engine.connect() as conn:
        current = await conn.run_sync(_current)
        populated = await conn.run_sync(_has_tables)
    head = head_revision()
    if current is None and not populated:
        await _build(engine)
        async with engine.connect() as conn:  # (built by another process meanwhile: at
            current = await conn.run_sync(_current)  # its revision, which may not be ours)
    if current == head:
        return
    raise SchemaOutOfDate(
        f"database {shown(db)} is at schema revision {current or 'none'}, this trialledger "
        f"needs {head}: run `trialledger db upgrade --db {shown(db)}` (back it up first)"
    )


# The schema alembic's revisions leave in an empty SQLite database, as the statements
# `sqlite_master` holds, in the order they were made (a view before the view it reads is
# fine: SQLite resolves a view's names when it is read). Kept from the first empty store a
# process builds, it builds the next ones in one transaction: alembic's operations cost
# ≈ 0.12 s of CPU per store, paid by whatever makes stores by the hundred (a test suite, a
# service with a store per job). tests/store/test_migrations.py compares the two.
_sqlite_schema: list[str] = []


async def _build(engine: AsyncEngine) -> None:
    """Build the schema in an empty database: by alembic's revisions, or on SQLite by the
    statements they left the last time (checked empty again under the write lock: another
    process may have built it meanwhile)."""
    if engine.dialect.name != "sqlite":
        await upgrade(engine)
    elif not _sqlite_schema:
        from alembic import command

        def keep(connection: Connection) -> None:  # read in alembic's own transaction
            _sqlite_schema[:] = _schema_statements(connection)

        await _run(engine, lambda config: command.upgrade(config, "head"), then=keep)
    else:
        async with engine.begin() as conn:  # BEGIN IMMEDIATE: all of it, or none
            if (await conn.exec_driver_sql("SELECT count(*) FROM sqlite_master")).scalar():
                return
            for statement in _sqlite_schema:
                await conn.exec_driver_sql(statement)


def _schema_statements(connection: Connection) -> list[str]:
    """The statements that make a SQLite database's schema and its alembic revision."""
    made = connection.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL "
        "AND name NOT LIKE 'sqlite_%' ORDER BY rowid").scalars().all()
    revision = _current(connection)
    return [*made, f"INSERT INTO alembic_version (version_num) VALUES ('{revision}')"]


async def upgrade_database(db: str, *, reader_role: str | None = None) -> str | None:
    """Build or migrate the database `db` to the newest schema (and, on PostgreSQL, create
    the read-only role `reader_role`); return the revision it is at."""
    try:
        async with open_engines(db) as engines:
            await upgrade(engines.writer)
            revision = await current_revision(engines.writer)
    except SQLAlchemyError as error:  # the store's boundary, as the Ledger's methods keep it
        raise store_error(db, error) from error
    if reader_role:
        await create_reader_role(db, reader_role)
    return revision
