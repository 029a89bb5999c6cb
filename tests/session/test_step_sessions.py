"""A multi-step task's step sessions in the log and the store (docs/SPEC.md §17):
`session.seeded` schema 2 carries `step`; `sessions.step_name`, `step_index`, `step_count`
(migration 0015) hold it; a schema-1 log reads and dumps as written."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from tests.scenarios import run_of, seed_data
from trialledger.core import BadEvent, SeedRejected, replay
from trialledger.core.events import SessionSeeded
from trialledger.core.parsing import event_dict, parse_event
from trialledger.store import Ledger
from trialledger.store.engine import open_engines
from trialledger.store.migrate import downgrade, upgrade

pytestmark = pytest.mark.anyio

STEP = {"name": "check", "index": 2, "count": 3}


async def raw(ledger: Ledger, sql: str) -> list[tuple[Any, ...]]:
    async with ledger._engines.writer.begin() as conn:
        return [tuple(r) for r in (await conn.execute(text(sql))).all()]


async def test_a_step_session_is_schema_2_and_its_row_names_the_step(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        stepped = (await ledger.seed({**seed_data(), "step": STEP})).session_id
        await ledger.append(stepped, run_of("clean"))
        plain = (await ledger.seed(seed_data())).session_id
        (seed,) = [e for e in await ledger.export(stepped) if e["seq"] == 1]
        assert seed["schema"] == 2 and seed["data"]["step"] == STEP
        # a one-step session's seed is written as before: schema 1, no `step` key
        (old,) = [e for e in await ledger.export(plain) if e["seq"] == 1]
        assert old["schema"] == 1 and "step" not in old["data"]
        rows = await raw(ledger, "SELECT session_id, step_name, step_index, step_count "
                                 "FROM sessions ORDER BY step_index")
        assert sorted(rows, key=repr) == sorted(
            [(stepped, "check", 2, 3), (plain, None, None, None)], key=repr)
        before = await raw(ledger, "SELECT * FROM sessions ORDER BY session_id")
        assert await ledger.rebuild_projections() == 2
        assert await raw(ledger, "SELECT * FROM sessions ORDER BY session_id") == before
        view = await ledger.view(stepped)
        first = view.events[0]
        assert isinstance(first, SessionSeeded) and first.data.step is not None
        assert first.data.step.name == "check"


@pytest.mark.parametrize("step", [
    {"name": "a", "index": 3, "count": 2}, {"name": "", "index": 1, "count": 1},
    {"name": "a", "index": 0, "count": 1}, {"name": "a", "index": 1}])
async def test_a_bad_step_in_a_seed_is_refused(tmp_path: Path, step: dict[str, Any]) -> None:
    async with await Ledger.open(str(tmp_path / "t.db")) as ledger:
        with pytest.raises(SeedRejected, match="step"):
            await ledger.seed({**seed_data(), "step": step})


def test_a_schema_1_log_still_reads_and_dumps_as_written() -> None:
    seed = {"type": "session.seeded", "at": "2026-11-29T10:00:00Z", "seq": 1,
            "session_id": "s-1", "schema": 1, "data": seed_data()}
    event = parse_event(seed)
    assert isinstance(event, SessionSeeded) and event.data.step is None
    dumped = event_dict(event)  # as written: no `step` key, so its hash is unchanged
    assert dumped["schema"] == 1 and "step" not in dumped["data"]
    assert event_dict(parse_event(dumped)) == dumped
    view = replay([seed, *({**e, "session_id": "s-1", "seq": n}
                           for n, e in enumerate(run_of("clean"), start=2))])
    assert isinstance(view.events[0], SessionSeeded) and len(view.events) > 2
    stepped = parse_event({**seed, "schema": 2, "data": {**seed_data(), "step": STEP}})
    assert event_dict(stepped)["data"]["step"] == STEP
    with pytest.raises(BadEvent, match="newer"):
        parse_event({**seed, "schema": 3})


async def test_migration_0015_adds_the_columns_and_drops_them_back(tmp_path: Path) -> None:
    db = str(tmp_path / "old.db")

    def columns() -> list[str]:
        with closing(sqlite3.connect(db)) as conn:
            return [row[1] for row in conn.execute("PRAGMA table_info(sessions)")]

    async with open_engines(db) as engines:
        await upgrade(engines.writer, "0014")
    assert "step_name" not in columns()
    async with open_engines(db) as engines:
        await upgrade(engines.writer)
    assert columns()[-3:] == ["step_name", "step_index", "step_count"]
    async with open_engines(db) as engines:
        await downgrade(engines.writer, "0014")
    assert "step_name" not in columns()
