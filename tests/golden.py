"""Golden transcripts: real Codex runs, recorded once, replayed in CI.

    python -m tests.golden record [--db DB] [--into FOLDER]
        # DB: a store with demo runs (else runs the demo); FOLDER: default tests/golden/v3

Each session becomes `<FOLDER>/<task>-<attempt>.jsonl`, its full exported log with the
decisions the machine recorded. `tests/golden/*.jsonl` were recorded before the model
proxy (policy v1, no `model.call`) and must keep replaying under their recorded policy;
`tests/golden/v3/` were recorded through the proxy (policy v3). `tests/test_golden.py`
re-derives every decision; a policy or machine change that decides differently fails with
a readable diff.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import anyio

from trialledger.store import Ledger

GOLDEN = Path(__file__).parent / "golden"


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
    parser.add_argument("command", choices=["record"])
    parser.add_argument("--db")
    parser.add_argument("--into", type=Path, default=GOLDEN / "v3")
    args = parser.parse_args()
    for path in anyio.run(record, args.db, args.into):
        print(path)
