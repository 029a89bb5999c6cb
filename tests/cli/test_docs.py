"""docs/SPEC.md is the project's own contract: every event type and data field the code
knows, every setting and every SQL view column appears in it; nothing points outside."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from sqlalchemy import Connection, inspect

from trialledger.core.events import EVENT_TYPES, Cause, Decision, Usage
from trialledger.core.settings import Settings
from trialledger.store.projections import TABLES

ROOT = Path(__file__).resolve().parents[2]
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
    for part in (Decision, Cause, Usage):
        missing += [f"{part.__name__}.{f}" for f in part.model_fields if f not in WORDS]
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


# README.md and docs/*.md: every command they name is one the CLI has, every view their
# SQL reads exists on a migrated store, and every question docs/sql.md asks runs on both
# databases.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SQL_PAGE = ROOT / "docs" / "sql.md"


def _code(text: str) -> list[str]:
    """The page's code: fenced blocks and inline code spans (prose is not checked)."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL)
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.DOTALL)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def _cli_commands() -> dict[str, set[str]]:
    """Each command of the CLI's parser, with its subcommands (empty when it has none)."""
    import argparse

    from trialledger.cli import build_parser

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return {name: sub for action in parser._actions
                if isinstance(action, argparse._SubParsersAction)
                for name, sub in action.choices.items()}

    return {name: set(subcommands(sub)) for name, sub in subcommands(build_parser()).items()}


def _named_commands(text: str) -> set[str]:
    found = set()
    for code in _code(text):
        for first, second in re.findall(
                r"(?:^|[\s(/])trialledger ([a-z][a-z-]*)(?:[ ]([a-z][a-z-]*))?", code,
                flags=re.MULTILINE):
            found.add(f"{first} {second}" if second else first)
    return found


def _sql_statements(text: str) -> list[str]:
    """Every SQL statement a page shows: its ```sql blocks and its `trialledger sql "..."`
    queries, comments left out."""
    statements = []
    for block in re.findall(r"```sql\n(.*?)```", text, flags=re.DOTALL):
        for part in block.split(";"):
            body = "\n".join(line for line in part.splitlines()
                             if not line.lstrip().startswith("--")).strip()
            if body:
                statements.append(body)
    statements += re.findall(r"trialledger sql[^\"`\n]*\"([^\"]+)\"", text)
    return [sql for sql in statements if "..." not in sql]  # `"SELECT ..."`: a placeholder


def test_every_command_the_docs_name_is_a_command_of_the_cli() -> None:
    commands = _cli_commands()
    named: dict[str, set[str]] = {}
    for page in PAGES:
        for command in _named_commands(page.read_text(encoding="utf-8")):
            named.setdefault(command, set()).add(page.name)
    assert "job show" in named and "view" in named  # the README's tour
    unknown = []
    for command, pages in sorted(named.items()):
        first, _, second = command.partition(" ")
        if first not in commands or (commands[first] and second
                                     and second not in commands[first]):
            unknown.append(f"{command} ({', '.join(sorted(pages))})")
        elif commands[first] and not second:
            unknown.append(f"{command} without a subcommand ({', '.join(sorted(pages))})")
    assert unknown == []


def test_the_docs_sql_runs_on_every_view_of_both_databases(db: str) -> None:
    import anyio
    from sqlalchemy import text

    from trialledger.store import upgrade_database
    from trialledger.store.engine import open_engines

    statements = [(page.name, sql) for page in PAGES
                  for sql in _sql_statements(page.read_text(encoding="utf-8"))]
    assert len([1 for name, _ in statements if name == "sql.md"]) >= 10

    async def run() -> tuple[set[str], list[str]]:
        await upgrade_database(db)
        failed = []
        async with open_engines(db) as engines, engines.reader.connect() as conn:
            names = set(await conn.run_sync(
                lambda c: [*inspect(c).get_table_names(), *inspect(c).get_view_names()]))
            for name, sql in statements:
                try:
                    await conn.execute(text(sql))
                except Exception as error:  # every failure listed, not only the first
                    failed.append(f"{name}: {sql.splitlines()[0]} ...: {error}".strip())
                    await conn.rollback()
        return names, failed

    names, failed = anyio.run(run)
    assert failed == []
    read = {view for _, sql in statements
            for view in re.findall(r"\b(?:FROM|JOIN)\s+([a-z_]+)", sql, flags=re.IGNORECASE)}
    assert read - names == set()


def test_docs_sql_md_lists_every_view_a_store_has_and_no_other(tmp_path: Path) -> None:
    """Every table or view the Datasette metadata shows (it hides the internal ones, and
    its own test keeps it complete) has a row in docs/sql.md's table, and each row is real."""
    import json
    import sqlite3

    from trialledger import cli

    db = tmp_path / "trials.db"
    assert cli.main(["db", "upgrade", "--db", str(db)]) == 0
    with sqlite3.connect(db) as conn:
        schema = {name for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
    meta = json.loads((ROOT / "docs" / "datasette-metadata.json").read_text())
    shown = {name for name, entry in meta["databases"]["trials"]["tables"].items()
             if not entry.get("hidden")}
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", SQL_PAGE.read_text(encoding="utf-8"),
                          flags=re.MULTILINE))
    assert sorted(shown - rows) == []
    assert sorted(rows - schema) == []
