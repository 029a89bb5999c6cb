"""The job page's two charts as plain geometry the template draws as inline SVG (no
plotting library, no script): a bar per task, and a histogram of tokens per trial."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

BAR_H, LABEL_W, PLOT_W = 18, 180, 320  # one bar's height, the label column, the bar area


@dataclass(frozen=True)
class Bar:
    """One horizontal bar: its label, value (None: no figure, drawn as a note), y and width."""

    label: str
    value: float | None
    y: int
    width: float


@dataclass(frozen=True)
class Chart:
    """Bars with the chart's size and the value a full-width bar stands for."""

    bars: list[Bar]
    width: int
    height: int
    scale: float
    label_w: int = LABEL_W


def bars(items: Sequence[tuple[str, float | None]], *, full: float | None = None) -> Chart:
    """Horizontal bars, one per (label, value); a full bar is `full` (else the largest
    value, at least 1), a negative value is drawn as none."""
    top = full if full is not None else max([1.0, *(v for _, v in items if v is not None)])
    drawn = [Bar(label, value, i * (BAR_H + 4),
                 0.0 if value is None or value <= 0 else PLOT_W * min(value / top, 1.0))
             for i, (label, value) in enumerate(items)]
    return Chart(drawn, LABEL_W + PLOT_W + 60, max(1, len(drawn)) * (BAR_H + 4), top)


@dataclass(frozen=True)
class Histogram:
    """Counts per bin of tokens, each bin's bounds, and the trials whose usage is unknown
    (never counted as 0 tokens)."""

    bins: list[tuple[int, int, int]]  # (low, high, count): low <= tokens < high
    unknown: int
    chart: Chart


def histogram(known: Sequence[int], unknown: int, *, bins: int = 10) -> Histogram:
    """Tokens per trial in `bins` equal bins from 0 to the largest, beside the unknown."""
    top = max(known, default=0)
    step = max(1, math.ceil((top + 1) / bins))
    counts = [0] * bins
    for tokens in known:
        counts[min(tokens // step, bins - 1)] += 1
    edges = [(i * step, (i + 1) * step, counts[i]) for i in range(bins)] if known else []
    chart = bars([(f"{low:,}–{high - 1:,}", float(n)) for low, high, n in edges])
    return Histogram(edges, unknown, chart)
