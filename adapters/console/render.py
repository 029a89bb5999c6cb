"""Where the command line prints (docs/SPEC.md §10): the console, tables and JSON.

Every human-readable line goes through `out`, a rich console that highlights nothing and
wraps at 132 columns when stdout is not a terminal; every cell of a `table` through
`plain`, since a value may come from the agent. `--json` output is `print_json`'s: the
data as stored.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from trialledger.adapters.console.plain import plain

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 132)


def print_json(value: Any) -> None:
    """`value` as indented JSON on stdout (dates and the like as their `str`)."""
    print(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """`rows` under `columns`, each cell shown as text and never obeyed."""
    shown = Table()
    for name in columns:  # folded, never cut with "…": an id must stay whole to be typed
        shown.add_column(name, overflow="fold")
    for row in rows:
        shown.add_row(*(plain(v) for v in row))
    out.print(shown)
