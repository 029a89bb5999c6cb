"""`ls`, `import` and `show` refuse a file that is not a trialledger store, or whose SQLite
header or schema is damaged, in one line naming `audit` (which alone reads a file whole)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.runs import in_process

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "clean.jsonl"


def _poke(at: Callable[[bytes], int], value: bytes) -> Callable[[bytearray], None]:
    def damage(data: bytearray) -> None:
        offset = at(bytes(data))
        data[offset:offset + len(value)] = value
    return damage


DAMAGE = {
    "header magic": _poke(lambda d: 0, b"SQLite format 4"),
    "page size": _poke(lambda d: 16, b"\x03\x00"),
    "payload fractions": _poke(lambda d: 21, b"\x41\x20\x20"),
    "text encoding": _poke(lambda d: 56, b"\x00\x00\x00\x09"),
    "schema b-tree page": _poke(lambda d: 100, b"\x07"),
    "schema text": _poke(lambda d: d.index(b"CREATE TABLE events"), b"CREATE TABXE"),
    "a table's name": _poke(lambda d: d.index(b"CREATE TABLE events") + 13, b"evXnts"),
}


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, str]:
    """A store holding the clean example, checkpointed into its one file."""
    db = tmp_path / "t.db"
    done = in_process("import", "--db", str(db), str(EXAMPLE))
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return db, done.stdout.strip()


def _refused_by_every_command(db: Path, session_id: str) -> None:
    for argv in (["ls", "--db", str(db)], ["import", "--db", str(db), str(EXAMPLE)],
                 ["show", "--db", str(db), session_id[:8]]):
        done = in_process(*argv)
        assert done.returncode == 2, (argv, done.stdout)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "trialledger audit" in lines[0], (argv, done.stderr)


@pytest.mark.parametrize("where", list(DAMAGE))
def test_a_damaged_header_or_schema_is_refused_naming_audit(
        store: tuple[Path, str], where: str) -> None:
    db, session_id = store
    data = bytearray(db.read_bytes())
    DAMAGE[where](data)
    db.write_bytes(bytes(data))
    _refused_by_every_command(db, session_id)


def test_a_file_that_is_not_a_trialledger_store_is_refused(tmp_path: Path) -> None:
    text, other = tmp_path / "notes.db", tmp_path / "other.db"
    text.write_text("not a database at all\n" * 20)
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE things (name TEXT)")
    for db in (text, other):
        _refused_by_every_command(db, "8231f9c2")


def test_a_sound_store_is_read_as_before(store: tuple[Path, str]) -> None:
    db, session_id = store
    assert in_process("ls", "--db", str(db)).returncode == 0
    assert in_process("show", "--db", str(db), session_id[:8]).returncode == 0
    assert in_process("import", "--db", str(db), str(EXAMPLE)).returncode == 0
