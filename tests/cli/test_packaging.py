"""SPEC §10: everything installs under `trialledger`, so a host project's own `core/`,
`store/` or `migrations/` neither shadows ours nor is shadowed by it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


LIGHT = """
import sys
from trialledger import cli
codes = [cli.main(["replay", "--log", sys.argv[1]])]
try:
    cli.main(["--help"])
except SystemExit as stopped:
    codes.append(stopped.code)
heavy = sorted(m for m in ("sqlalchemy", "alembic", "asyncpg", "aiosqlite") if m in sys.modules)
print(codes, heavy, file=sys.stderr)
"""


def test_help_and_replay_of_a_log_do_not_load_the_database_stack() -> None:
    """`--help` and `replay --log` need no database: SQLAlchemy and alembic stay unloaded,
    which halves their start-up (docs/library.md)."""
    log = Path(__file__).resolve().parents[2] / "examples" / "clean.jsonl"
    done = subprocess.run([sys.executable, "-c", LIGHT, str(log)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stderr.strip() == "[0, 0] []", done.stderr


ORACLE_START = """
import sys, anyio
from trialledger.cli import main
from trialledger.adapters.jobs import queue as jobs
from trialledger.adapters.session import runner
from trialledger.store import Ledger

async def opened(db):  # as every run opens its store
    async with await Ledger.open(db):
        pass

anyio.run(opened, sys.argv[1])
print(sorted({n.split(".")[0] for n in sys.modules} & {"alembic", "aiohttp"}), file=sys.stderr)
"""


def test_a_run_of_the_oracle_opens_a_current_store_without_alembic_or_aiohttp(
        tmp_path: Path) -> None:
    """A job's start loads neither alembic (a current store's revision is one query) nor
    aiohttp (only a session with a proxy needs it; an oracle's has none): a fifth of a
    second each, paid by every `job run` (BENCHMARKS.md, the warm figures)."""
    import anyio

    from trialledger.store import Ledger

    async def build() -> None:
        async with await Ledger.open(str(tmp_path / "t.db")):
            pass

    anyio.run(build)
    done = subprocess.run([sys.executable, "-c", ORACLE_START, str(tmp_path / "t.db")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stderr.strip() == "[]", done.stderr


@pytest.mark.slow
def test_a_second_distribution_with_core_and_cli_neither_replaces_nor_removes_ours(
        tmp_path: Path) -> None:
    # A fresh venv holding our wheel and another distribution that ships a top-level
    # `core` package and `cli.py` (as many projects do); uninstalling it keeps ours whole.
    root = Path(__file__).resolve().parents[2]
    other = tmp_path / "other"
    (other / "core").mkdir(parents=True)
    (other / "core" / "__init__.py").write_text("MINE = 'other'\n")
    (other / "cli.py").write_text("MINE = 'other'\n")
    (other / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "other-tool"\nversion = "1.0"\n'
        '[tool.setuptools]\npackages = ["core"]\npy-modules = ["cli"]\n')
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")

    def sh(*argv: str) -> str:  # (run away from this checkout, whose core/ is not installed)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    sh(sys.executable, "-m", "venv", "--without-pip", str(venv))
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q"]
    sh(*pip, "--no-deps", str(root), str(other))
    site = sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    ours = sorted(p.relative_to(site).as_posix()
                  for p in Path(site, "trialledger").rglob("*.py"))
    probe = ("import core, cli, importlib.util as u; "
             "print(core.MINE, cli.MINE, u.find_spec('trialledger.core').origin, "
             "u.find_spec('trialledger.cli').origin)")
    mine_core, mine_cli, our_core, our_cli = sh(python, "-c", probe).split()
    assert (mine_core, mine_cli) == ("other", "other")
    assert our_core.endswith("trialledger/core/__init__.py") and our_cli.endswith(
        "trialledger/cli.py")
    sh(sys.executable, "-m", "pip", "--python", python, "uninstall", "-q", "-y", "other-tool")
    assert sorted(p.relative_to(site).as_posix()
                  for p in Path(site, "trialledger").rglob("*.py")) == ours
