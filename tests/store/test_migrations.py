"""Migrations: a populated database from every earlier revision upgrades with its data."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import Connection, inspect, text
from sqlalchemy.engine.interfaces import ReflectedColumn

from tests.scenarios import SCENARIOS
from trialledger.store import Ledger, SchemaOutOfDate, migrate
from trialledger.store.engine import open_engines
from trialledger.store.migrate import (
    current_revision,
    downgrade,
    head_revision,
    revisions,
    upgrade,
)

pytestmark = pytest.mark.anyio
CASES = ["clean", "http_429", "recovered_then_killed_probe", "timeout", "sandbox_lost"]


async def _rows(db: str, tables: list[str], columns: list[str] | None = None
                ) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of each table (only `columns`, in that order, when given)."""
    shown = ", ".join(columns) if columns else "*"
    async with open_engines(db) as engines, engines.reader.begin() as conn:
        return {t: sorted((tuple(r) for r in await conn.execute(
            text(f"SELECT {shown} FROM {t}"))), key=repr) for t in tables}


def _columns(conn: Connection, table: str) -> list[ReflectedColumn]:
    return inspect(conn).get_columns(table)


async def _tables(db: str) -> list[str]:
    async with open_engines(db) as engines, engines.reader.connect() as conn:
        names = await conn.run_sync(lambda c: inspect(c).get_table_names())
        return sorted(n for n in names if n != "alembic_version")


@pytest.fixture(scope="module")
def references() -> dict[str, str]:
    """Each kind's reference store, built by the first test that needs it: the same
    sessions, written by today's code (every revision's test compares with it)."""
    return {}


@pytest.mark.parametrize("start", revisions()[:-1])
async def test_a_populated_database_upgrades_from_every_earlier_revision(
        start: str, tmp_path: Any, tmp_path_factory: pytest.TempPathFactory,
        request: pytest.FixtureRequest, references: dict[str, str]) -> None:
    for kind in ("sqlite", "postgresql"):
        if kind == "sqlite":
            old = str(tmp_path / f"old-{start}.db")
        else:
            old = request.getfixturevalue("postgres").create_database()
        if kind not in references:
            references[kind] = (
                str(tmp_path_factory.mktemp("reference") / "ref.db") if kind == "sqlite"
                else request.getfixturevalue("postgres").create_store())
            async with await Ledger.open(references[kind]) as ledger:
                for name in CASES:
                    await ledger.import_log(SCENARIOS[name][0].events)
        reference = references[kind]
        async with open_engines(old) as engines:
            await upgrade(engines.writer, start)
        shared = sorted(set(await _tables(old)) & set(await _tables(reference)))
        async with open_engines(old) as engines:
            async with engines.writer.begin() as conn:  # the same data, as the old schema held it
                for table in shared:
                    columns = await conn.run_sync(_columns, table)
                    names = [col["name"] for col in columns]
                    flags = [str(col["type"]) == "BOOLEAN" for col in columns]
                    for row in (await _rows(reference, [table], names))[table]:
                        marks = ", ".join(f":c{i}" for i in range(len(row)))
                        await conn.execute(text(f"INSERT INTO {table} VALUES ({marks})"), {
                            f"c{i}": bool(v) if flag else v
                            for i, (v, flag) in enumerate(zip(row, flags, strict=True))})
            await upgrade(engines.writer)
            assert await current_revision(engines.writer) == head_revision()
        everything = await _tables(reference)
        assert await _rows(old, [*everything, "outcomes"]) == await _rows(
            reference, [*everything, "outcomes"])
        async with await Ledger.open(old) as ledger:
            assert (await ledger.audit()).ok
            assert len(await ledger.sessions()) == len(CASES)


def _schema(db: str) -> dict[str, Any]:
    """A SQLite database's schema: each table's columns, each view's and index's text (its
    spacing aside)."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        entries = conn.execute("SELECT type, name, sql FROM sqlite_master "
                               "WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name").fetchall()
        return {name: (conn.execute(f"PRAGMA table_info({name})").fetchall() if kind == "table"
                       else " ".join(sql.split())) for kind, name, sql in entries}


async def test_each_downgrade_leaves_the_schema_its_revision_built(tmp_path: Path) -> None:
    """Down one revision at a time from the head, a SQLite store has at each the tables,
    columns, views and indexes the upgrade to that revision made (the downgrades that drop
    a column set the views aside and make them again: none lost, none changed)."""
    db = str(tmp_path / "t.db")
    built: dict[str, dict[str, Any]] = {}
    for revision in revisions():
        async with open_engines(db) as engines:
            await upgrade(engines.writer, revision)
        built[revision] = _schema(db)
    for revision in reversed(revisions()[:-1]):
        async with open_engines(db) as engines:
            await downgrade(engines.writer, revision)
        assert _schema(db) == built[revision], revision


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_flags_are_integers_an_analyst_can_sum(
        kind: str, tmp_path: Any, request: pytest.FixtureRequest) -> None:
    db = (str(tmp_path / "t.db") if kind == "sqlite"
          else request.getfixturevalue("postgres").create_database())
    async with await Ledger.open(db) as ledger:
        for name in CASES:
            await ledger.import_log(SCENARIOS[name][0].events)
    async with open_engines(db) as engines, engines.reader.begin() as conn:
        for view in ("outcomes", "decisions"):
            total = (await conn.execute(text(
                f"SELECT SUM(reward_valid), COUNT(*) FROM {view} WHERE reward_valid = 1"
            ))).one()
            assert total[0] == total[1] > 0


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_the_revision_read_without_alembic_is_alembics(
        kind: str, tmp_path: Any, request: pytest.FixtureRequest) -> None:
    """Opening a store reads its revision with one query and the code's head from the
    revision files' numbers, never importing alembic: both agree with alembic's own
    reading, at the head and at an earlier revision."""
    db = (str(tmp_path / "t.db") if kind == "sqlite"
          else request.getfixturevalue("postgres").create_database())
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from trialledger.store.migrate import alembic_config

    assert head_revision() == ScriptDirectory.from_config(alembic_config()).get_current_head()
    async with open_engines(db) as engines:
        assert await current_revision(engines.writer) is None  # an empty database
        for target in (revisions()[-3], "head"):
            await upgrade(engines.writer, target)
            async with engines.writer.connect() as conn:
                theirs = await conn.run_sync(
                    lambda c: MigrationContext.configure(c).get_current_revision())
            assert await current_revision(engines.writer) == theirs
    assert theirs == head_revision()


def _sqlite_schema(path: Path) -> tuple[list[Any], list[Any]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return (sorted(conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")),
                conn.execute("SELECT version_num FROM alembic_version").fetchall())


async def test_an_empty_sqlite_store_after_the_first_is_built_as_alembic_builds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process's first empty SQLite store is built by alembic's revisions, the next ones
    from the schema they left: the same tables, indexes, views and revision, and a store
    that holds sessions as the first does."""
    monkeypatch.setattr(migrate, "_sqlite_schema", [])  # as in a process that built none
    first, second = tmp_path / "first.db", tmp_path / "second.db"
    async with await Ledger.open(str(first)):
        pass

    async def no_alembic(*_: Any, **__: Any) -> None:
        raise AssertionError("alembic's revisions ran again for an empty store")

    monkeypatch.setattr(migrate, "_run", no_alembic)
    async with await Ledger.open(str(second)) as ledger:
        for name in CASES:
            await ledger.import_log(SCENARIOS[name][0].events)
        assert (await ledger.audit()).ok
        assert len(await ledger.sessions()) == len(CASES)
    assert _sqlite_schema(second) == _sqlite_schema(first)
    assert len(_sqlite_schema(first)[0]) > 20  # (its tables, indexes and views)


async def test_two_opens_of_one_new_sqlite_store_build_it_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stores opened at once on one new file (two workers of a new job), both having
    found it empty: one builds the schema, the other finds it built under the write lock
    and opens it."""
    async with await Ledger.open(str(tmp_path / "before.db")):  # the schema is kept
        pass
    path = tmp_path / "new.db"
    build, arrived, both = migrate._build, [], anyio.Event()

    async def together(engine: Any) -> None:  # each builds once both have found it empty
        arrived.append(engine)
        if len(arrived) == 2:
            both.set()
        with anyio.fail_after(30):
            await both.wait()
        await build(engine)

    monkeypatch.setattr(migrate, "_build", together)

    async def one() -> None:
        async with await Ledger.open(str(path)) as ledger:
            assert await ledger.sessions() == []

    async with anyio.create_task_group() as group:
        group.start_soon(one)
        group.start_soon(one)
    assert len(arrived) == 2
    assert _sqlite_schema(path) == _sqlite_schema(tmp_path / "before.db")


async def test_a_new_store_found_built_by_an_older_trialledger_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new file found built meanwhile by another process at an older revision (a worker
    of an older trialledger) is refused as out of date, naming the upgrade: never opened
    as if it held today's schema."""
    async def older(engine: Any) -> None:
        await migrate.upgrade(engine, revisions()[-2])

    monkeypatch.setattr(migrate, "_build", older)
    with pytest.raises(SchemaOutOfDate, match="trialledger db upgrade"):
        await Ledger.open(str(tmp_path / "new.db"))
