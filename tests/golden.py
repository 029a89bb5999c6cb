"""Golden transcripts: real Codex runs, recorded once, replayed in CI.

    python -m tests.golden record [--db DB] [--into FOLDER]
        # DB: a store with demo runs (else runs the demo); FOLDER: default tests/golden/v3

    python -m tests.golden atif
        # rewrite tests/golden/atif/: the ATIF trajectory of each sample log

Each session becomes `<FOLDER>/<task>-<attempt>.jsonl`, its full exported log with the
decisions the machine recorded. `tests/golden/*.jsonl` were recorded before the model
proxy (policy v1, no `model.call`) and must keep replaying under their recorded policy;
`tests/golden/v3/` were recorded through the proxy (policy v3). `tests/core/test_golden.py`
re-derives every decision; a policy or machine change that decides differently fails with
a readable diff.

`tests/golden/atif/<folder>-<name>.json` is the ATIF trajectory (`core.atif`, docs/SPEC.md §18) of
each of `ATIF_SOURCES`: `tests/core/test_atif.py` compares it and validates it with Harbor's own
`Trajectory` model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import anyio

from trialledger.store import Ledger

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).parent.parent
ATIF = GOLDEN / "atif"
# The sample logs (examples/) and the real Codex runs recorded through the proxy.
ATIF_SOURCES = sorted([*(ROOT / "examples").glob("*.jsonl"), *(GOLDEN / "v3").glob("*.jsonl")])


def atif_golden(source: Path) -> Path:
    """The golden ATIF file of one sample log."""
    return ATIF / f"{source.parent.name}-{source.stem}.json"


def atif_of(source: Path) -> dict[str, Any]:
    """The ATIF trajectory of one sample log, as `show --atif` prints it."""
    from trialledger.core import replay
    from trialledger.core.atif import trajectory

    events = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines()]
    return trajectory(replay(events))


def atif_text(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def write_atif() -> list[Path]:
    """Rewrite every golden ATIF file."""
    ATIF.mkdir(exist_ok=True)
    written = []
    for source in ATIF_SOURCES:
        path = atif_golden(source)
        path.write_text(atif_text(atif_of(source)), encoding="utf-8")
        written.append(path)
    return written


async def export_all(db: str, folder: Path = GOLDEN) -> list[Path]:
    """Write every session of a store as a golden transcript."""
    folder.mkdir(exist_ok=True)
    written = []
    async with await Ledger.open(db) as ledger:
        for row in await ledger.sessions():
            path = folder / f"{row['task']}-{row['attempt']}.jsonl"
            lines = await ledger.export(row["session_id"])
            path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n"
                                    for line in lines), encoding="utf-8")
            written.append(path)
    return written


async def record(db: str | None, folder: Path = GOLDEN / "v3") -> list[Path]:
    """Run the demo (unless a store is given) and export its sessions."""
    if db is None:
        from tests.runs import codex_path
        from trialledger.adapters.demo.samples import run_demo

        db = str(Path(tempfile.mkdtemp()) / "golden.db")
        async with await Ledger.open(db) as ledger:
            await run_demo(ledger, codex=codex_path())
    return await export_all(db, folder)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=["record", "atif"])
    parser.add_argument("--db")
    parser.add_argument("--into", type=Path, default=GOLDEN / "v3")
    args = parser.parse_args()
    if args.command == "atif":
        for path in write_atif():
            print(path)
        raise SystemExit(0)
    for path in anyio.run(record, args.db, args.into):
        print(path)
