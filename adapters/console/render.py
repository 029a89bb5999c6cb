"""Where the command line prints (docs/SPEC.md §10): the console, tables and JSON.

Every human-readable line goes through `out`, a rich console that highlights nothing and
wraps at 132 columns when stdout is not a terminal; every cell of a `table` through
`plain`, since a value may come from the agent. `--json` output is `print_json`'s: the
data as stored.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from trialledger.adapters.console.plain import plain

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 132)


def print_json(value: Any) -> None:
    """`value` as indented JSON on stdout (dates and the like as their `str`)."""
    print(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
          whole: Collection[str] = ()) -> None:
    """`rows` under `columns`, each cell shown as text and never obeyed. The `whole`
    columns keep their natural width while the others fold to fit (a figure is never
    split while a name can be)."""
    out.print(_built(columns, rows, whole=whole))


def table_width(columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
                capped: Mapping[str, int] | None = None) -> int:
    """How many columns `table` takes to show every cell on one line, the `capped`
    columns counted at most their cap (beyond it they fold)."""
    shown = _built(columns, rows)
    for column in shown.columns:
        column.max_width = (capped or {}).get(str(column.header))
    return Measurement.get(out, out.options.update_width(1 << 20), shown).maximum


def _built(columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
           whole: Collection[str] = ()) -> Table:
    cells = [[plain(v) for v in row] for row in rows]
    shown = Table()
    for i, name in enumerate(columns):  # folded, never cut with "…": an id must stay whole
        width = max([len(name), *(c[i].cell_len for c in cells)]) if name in whole else None
        shown.add_column(name, overflow="fold", width=width)
    for row in cells:
        shown.add_row(*row)
    return shown
