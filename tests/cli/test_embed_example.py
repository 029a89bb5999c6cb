"""examples/embed.py runs as docs/library.md shows it, on SQLite and PostgreSQL."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trialledger.core import SeedRejected
from trialledger.core.seed import validate_seed

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "embed.py"


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_embedding_example_runs(kind: str, tmp_path: Path,
                                    request: pytest.FixtureRequest) -> None:
    db = (str(tmp_path / "embedded.db") if kind == "sqlite"
          else request.getfixturevalue("postgres").create_database())
    done = subprocess.run([sys.executable, str(EXAMPLE), db], capture_output=True, text=True,
                          timeout=120, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    _, state, rule, action, tokens = done.stdout.split()
    assert (state, rule, action, tokens) == ("graded", "completed", "verify", "24885")


def test_the_library_page_shows_the_example_line_for_line() -> None:
    page = (ROOT / "docs" / "library.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    body = EXAMPLE.read_text(encoding="utf-8").split('"""', 2)[2].lstrip("\n")
    assert body in blocks


def test_a_seed_error_names_every_missing_field() -> None:
    with pytest.raises(SeedRejected) as caught:
        validate_seed({"task": "t"})
    for field in ("trial_id", "attempt", "runner_id", "instruction", "agent", "model"):
        assert field in str(caught.value)
