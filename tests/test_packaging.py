"""SPEC §10: everything installs under `trialledger`, so a host project's own `core/`,
`store/` or `migrations/` neither shadows ours nor is shadowed by it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EMBED = """
import anyio, core, migrations
from trialledger.store import Ledger
from trialledger.core import replay, redact, scrub

async def main():
    async with await Ledger.open("embedded.db") as ledger:
        print(core.MINE, migrations.MINE, type(ledger).__name__, callable(replay))

anyio.run(main)
"""


def test_a_service_with_its_own_core_and_migrations_embeds_the_store(tmp_path: Path) -> None:
    for name in ("core", "migrations", "store", "adapters"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"MINE = '{name}-of-the-service'\n")
    (tmp_path / "cli.py").write_text("raise SystemExit('the service cli, not ours')\n")
    done = subprocess.run([sys.executable, "-c", EMBED], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["core-of-the-service", "migrations-of-the-service",
                                   "Ledger", "True"]
    assert (tmp_path / "embedded.db").stat().st_size > 0


def test_the_command_runs_from_the_installed_package(tmp_path: Path) -> None:
    (tmp_path / "cli.py").write_text("raise SystemExit('the service cli, not ours')\n")
    done = subprocess.run([sys.executable, "-m", "trialledger.cli", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "replay" in done.stdout, done.stderr
