"""STYLE: arrows point inward; core/ imports nothing that does I/O or lives outside it."""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = {
    "sqlalchemy", "aiosqlite", "asyncpg", "alembic", "anyio", "asyncio", "subprocess", "socket",
    "os", "pathlib", "shutil", "io", "threading", "multiprocessing", "urllib", "http",
    "store", "adapters", "cli", "migrations", "..",
}
CORE = Path(__file__).resolve().parents[2] / "core"


def _root(module: str) -> str:
    """`os.path` → `os`; our own `trialledger.store.x` → `store` (the layer it names)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "trialledger" and len(parts) > 1 else parts[0]


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots |= {_root(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(_root(node.module))
            if node.module == "trialledger":
                roots |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level > 1:
            roots.add("..")  # a relative import that climbs out of core
    return roots


def test_core_imports_nothing_outward() -> None:
    files = sorted(CORE.glob("*.py"))
    assert len(files) > 5
    leaks = {p.name: sorted(_imported_roots(p) & FORBIDDEN) for p in files}
    assert {name: bad for name, bad in leaks.items() if bad} == {}


def test_the_purity_check_sees_a_leak(tmp_path: Path) -> None:
    leaky = tmp_path / "leaky.py"
    leaky.write_text("import os.path\nfrom sqlalchemy import text\n"
                     "from trialledger.store import Ledger\nfrom trialledger import cli\n"
                     "from ..adapters import runner\n", encoding="utf-8")
    assert _imported_roots(leaky) & FORBIDDEN == {"os", "sqlalchemy", "store", "cli", ".."}
