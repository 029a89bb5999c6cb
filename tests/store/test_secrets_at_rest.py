"""No piece (8+ characters) of a session's token is found in the database files' bytes, nor
in the rollouts it archives."""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import zstandard
from sqlalchemy import text

from tests.scenarios import run_of, seed_data
from tests.views import seeded
from trialledger.store import Ledger

TOKEN = "zq7-SECRET-Xv93kLmN0pQrStUv"
API_KEY = "sk-Hh4Jj5Kk6Ll7Mm8Nn9Pp0"


def _pieces(secret: str) -> list[bytes]:
    return [secret[i:i + 8].encode() for i in range(len(secret) - 7)]


async def _record(db: str) -> None:
    grants = [{"name": "docs", "kind": "mcp", "url": "http://127.0.0.1:1/mcp",
               "headers": {"Authorization": f"Bearer {TOKEN}", "X-Other": API_KEY[:3]}}]
    echoes = [TOKEN, TOKEN[:12] + "…", f'"Bearer {TOKEN}"', TOKEN[:9] + TOKEN,
              f"key={API_KEY} and {API_KEY[:10]}"]
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data(grants=grants), api_key=API_KEY)).session_id
        events = run_of("clean")
        stderr = {"type": "agent.stderr", "at": "2026-11-29T09:00:00Z",
                  "data": {"tail": "\n".join(echoes), "truncated": False}}
        shell = {"type": "item.completed", "at": "2026-11-29T09:00:00Z", "data": {"item": {
            "id": "item_9", "type": "command_execution", "command": "cat config.toml",
            "aggregated_output": f'http_headers = {{ Authorization = "Bearer {TOKEN}" }}',
            "exit_code": 0, "status": "completed"}}}
        await ledger.append(sid, [*events[:4], shell, *events[4:6], stderr, *events[6:]])
        view = await ledger.view(sid)
        assert view.decision is not None and view.decision.rule == "completed"
        if ledger.dialect == "postgresql":
            async with ledger._engines.writer.connect() as conn:
                await conn.execute(text("CHECKPOINT"))


def _files_hold_no_piece(files: list[Path]) -> None:
    assert files
    blob = b"".join(p.read_bytes() for p in files if p.is_file())
    assert b"[redacted]" in blob  # the echoes were stored, scrubbed
    for secret in (TOKEN, API_KEY):
        found = [piece for piece in _pieces(secret) if piece in blob]
        assert not found, f"{found[0]!r} of a secret is on disk"


def test_sqlite_file_and_wal_hold_no_secret(tmp_path: Path) -> None:
    db = tmp_path / "trials.db"
    anyio.run(_record, str(db))
    _files_hold_no_piece(sorted(tmp_path.glob("trials.db*")))


def _written(postgres: Any, record: Callable[[str], Awaitable[Any]]) -> list[Path]:
    """`record` run on a new database of the server: the files that database's data can be
    in — its own folder, the shared catalogs and the write-ahead log from where it stood
    before (not every other test's database this server holds, whose reading took 17 s)."""
    first = postgres.query("SELECT pg_walfile_name(pg_current_wal_lsn())")
    db = postgres.create_database()
    anyio.run(record, db)
    oid = postgres.query(f"SELECT oid FROM pg_database WHERE datname = '{db.rsplit('/', 1)[1]}'")
    data = Path(postgres.folder, "data")
    wal = [p for p in (data / "pg_wal").iterdir() if len(p.name) == 24 and p.name >= first]
    return sorted([*(data / "base" / oid).rglob("*"), *(data / "global").rglob("*"), *wal])


def test_postgresql_data_folder_holds_no_secret(postgres: Any) -> None:
    _files_hold_no_piece(_written(postgres, _record))


@pytest.mark.parametrize("secret", [TOKEN, API_KEY])
def test_the_check_would_see_a_leak(tmp_path: Path, secret: str) -> None:
    leak = tmp_path / "leak.bin"
    leak.write_bytes(b"[redacted] ... " + secret[3:14].encode())
    with pytest.raises(AssertionError, match="of a secret is on disk"):
        _files_hold_no_piece([leak])


def _raw_seed_log() -> list[dict[str, Any]]:
    """A log from another harness whose seed carries the raw header value."""
    seed = seed_data(grants=[{"name": "docs", "kind": "mcp", "url": "http://127.0.0.1:1/mcp",
                              "headers": {"Authorization": f"Bearer {TOKEN}"}}])
    echo = {"type": "agent.stderr", "at": "2026-11-29T09:00:00Z",
            "data": {"tail": f"token was {TOKEN}", "truncated": False}}
    events = run_of("clean")
    return [{"type": "session.seeded", "at": "2026-11-29T08:00:00Z", "data": seed},
            *events[:5], echo, *events[5:]]


async def _import_raw(db: str) -> str:
    async with await Ledger.open(db) as ledger:
        sid = await ledger.import_log(_raw_seed_log())
        if ledger.dialect == "postgresql":
            async with ledger._engines.writer.connect() as conn:
                await conn.execute(text("CHECKPOINT"))
        view = await ledger.view(sid)
    (grant,) = seeded(view).grants
    assert grant.headers == {"Authorization": "[redacted]"}
    assert grant.header_fingerprints["Authorization"].startswith("sha256:")
    return sid


def test_an_imported_raw_seed_is_sealed_sqlite(tmp_path: Path) -> None:
    anyio.run(_import_raw, str(tmp_path / "trials.db"))
    _files_hold_no_piece(sorted(tmp_path.glob("trials.db*")))


def test_an_imported_raw_seed_is_sealed_postgresql(postgres: Any) -> None:
    _files_hold_no_piece(_written(postgres, _import_raw))


def test_a_replayed_raw_seed_shows_no_token() -> None:
    from trialledger.core import replay

    view = replay(_raw_seed_log())
    shown = view.model_dump_json()
    assert TOKEN[:8] not in shown and "[redacted]" in shown


def test_scrub_expands_authorization_schemes_itself() -> None:
    from trialledger.core import redact, scrub

    for scheme in ("Bearer", "basic", "TOKEN"):
        header = f"{scheme} {TOKEN}"
        assert scrub(f"raw {TOKEN} and cut {TOKEN[:10]}", [header]) == (
            "raw [redacted] and cut [redacted]")
        assert TOKEN[:8] not in redact(f"x {TOKEN}", [header])


# --- the archive: a compressed rollout is decompressed and scrubbed, never kept raw --------


def _zst_rollout(text: str, *, damaged: bool = False) -> str:
    """A rollout line holding `text`, zstd-compressed (a frame of garbage after it when
    `damaged`), base64'd for a shell command: the command itself never holds `text`."""
    line = json.dumps({"timestamp": "2026-11-29T09:00:00Z", "type": "response_item",
                       "payload": {"type": "function_call_output", "output": text}})
    blob = zstandard.ZstdCompressor().compress(f"{line}\n".encode())
    return base64.b64encode(blob + (b"\x28\xb5\x2f\xfd" + b"\xff" * 64 if damaged else b"")
                            ).decode()


@pytest.mark.anyio
async def test_a_compressed_rollout_is_archived_without_the_secret(tmp_path: Path) -> None:
    from tests.runs import make_task, run_task
    from trialledger.adapters.demo.endpoint import message, shell

    archive = tmp_path / "archive"
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    # Codex may write its rollout as `.jsonl.zst`; the agent plants two beside its own, each
    # holding the endpoint key it got hold of: one whole, one damaged after its first frame.
    plant = ("f=$(find $CODEX_HOME/sessions -name 'rollout-*.jsonl' | head -1); "
             "d=$(dirname $f); "
             f"echo {_zst_rollout(f'whole key={API_KEY}')} | base64 -d "
             "> $d/rollout-zz-whole.jsonl.zst; "
             f"echo {_zst_rollout(f'cut key={API_KEY}', damaged=True)} | base64 -d "
             "> $d/rollout-zz-damaged.jsonl.zst; echo planted")
    ran = await run_task(str(tmp_path / "t.db"), task, [shell(plant), message()],
                         api_key=API_KEY, settings={"sandbox_logs_dir": str(archive)})
    assert ran.view.outcome == "verify"
    files = [p for p in archive.rglob("*") if p.is_file()]
    names = sorted(p.name for p in files if p.name.startswith("rollout-zz"))
    assert names == ["rollout-zz-whole.jsonl"], names  # decompressed; the damaged one left out
    whole = next(p for p in files if p.name == "rollout-zz-whole.jsonl").read_text()
    assert "whole key=[redacted]" in whole and not any(p.suffix == ".zst" for p in files)
    _files_hold_no_piece(files)  # nor Codex's own rollout, nor the kept verifier files
    unscrubbed = [e.data.detail or "" for e in ran.view.events
                  if e.type == "gap.recorded" and e.data.code == "archive_unscrubbed"]
    assert len(unscrubbed) == 1 and "rollout-zz-damaged.jsonl.zst: not a zstd stream" in (
        unscrubbed[0]), unscrubbed
