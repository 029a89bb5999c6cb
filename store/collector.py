"""The garbage collector's thresholds for a process that appends at volume.

Every appended event lives through at least one group commit of a thousand others, and an
open session keeps its events folded: nearly nothing the store allocates is garbage, so
with CPython's default thresholds (700, 10, 10) the collector keeps walking survivors — a
quarter of an append's CPU in BENCHMARKS.md, a third of an import's. Raising the first
threshold lets it run a seventieth as often, for a few MB more of young objects at most.

The store never calls this itself (a library does not change its caller's collector);
the `trialledger` command does, for its own process, and a service that embeds the store
may call it at start-up.
"""

from __future__ import annotations

import gc

THRESHOLDS = (50_000, 20, 100)


def tune_collector() -> tuple[int, int, int]:
    """Set this process's collector thresholds to `THRESHOLDS`; return the ones it had."""
    previous = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    return previous
