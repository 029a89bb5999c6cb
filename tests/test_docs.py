"""docs/SPEC.md is the project's own contract: every event type and data field the code
knows, every setting and every SQL view column appears in it; nothing points outside."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from sqlalchemy import Connection, inspect

from trialledger.core import EVENT_TYPES, Settings
from trialledger.core.events import Cause, Decision, Usage
from trialledger.store.projections import TABLES

ROOT = Path(__file__).resolve().parent.parent
SPEC = (ROOT / "docs" / "SPEC.md").read_text(encoding="utf-8")
WORDS = set(re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", SPEC))


def test_every_event_type_and_field_is_specified() -> None:
    missing = []
    for kind, model in EVENT_TYPES.items():
        if f"`{kind}`" not in SPEC:
            missing.append(kind)
        data = model.model_fields["data"].annotation
        for field in getattr(data, "model_fields", {}):
            if field not in WORDS:
                missing.append(f"{kind}.{field}")
    for model in (Decision, Cause, Usage):
        missing += [f"{model.__name__}.{f}" for f in model.model_fields if f not in WORDS]
    assert missing == []


def test_every_setting_is_specified() -> None:
    assert [name for name in Settings.model_fields if f"`{name}`" not in SPEC] == []


def test_every_sql_view_column_is_specified(tmp_path: Path) -> None:
    import anyio

    from trialledger.store import Ledger
    from trialledger.store.engine import open_engines

    async def columns() -> dict[str, list[str]]:
        db = str(tmp_path / "t.db")
        async with await Ledger.open(db):
            pass
        async with open_engines(db) as engines, engines.reader.connect() as conn:
            def read(c: Connection) -> dict[str, list[str]]:
                found = inspect(c)
                names = [*found.get_view_names(), *TABLES, "events"]
                return {n: [col["name"] for col in found.get_columns(n)]
                        for n in names if n not in ("decision_log",)}
            return await conn.run_sync(read)

    views = anyio.run(columns)
    assert {"outcomes", "decisions", "sessions", "tool_calls", "gaps", "rewards"} <= set(views)
    missing = [f"{view}.{col}" for view, cols in views.items() for col in cols
               if col not in WORDS]
    assert missing == []


def test_nothing_points_outside_the_repository() -> None:
    outside = "../" + "shared"  # spelled apart, so this file does not match itself
    tracked = subprocess.run(["git", "grep", "-l", outside, "--", ":!*.lock"], cwd=ROOT,
                             capture_output=True, text=True, check=False).stdout.split()
    assert tracked == []


def test_the_datasette_metadata_describes_every_view_and_hides_the_rest(tmp_path: Path
                                                                       ) -> None:
    """docs/datasette-metadata.json: each table or view a migrated store has is either
    described or hidden, and every column it names exists."""
    import json
    import sqlite3

    from trialledger import cli

    db = tmp_path / "trials.db"
    assert cli.main(["db", "upgrade", "--db", str(db)]) == 0
    with sqlite3.connect(db) as conn:
        schema = {name: {row[1] for row in conn.execute(f"PRAGMA table_info({name})")}
                  for (name,) in conn.execute(
                      "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
    meta = json.loads((ROOT / "docs" / "datasette-metadata.json").read_text())
    tables = meta["databases"]["trials"]["tables"]
    assert set(tables) == set(schema)
    for name, entry in tables.items():
        assert entry.get("hidden") or entry.get("description"), name
        assert set(entry.get("columns", {})) <= schema[name], name
