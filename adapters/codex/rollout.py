"""Codex session rollouts → `usage.native` events (SPEC §2.3).

A rollout (`$CODEX_HOME/sessions/YYYY/MM/DD/rollout-*.jsonl`) carries `token_count` events
whose `info.total_token_usage` is the session's running total. They repeat (one fires when
rate-limit headers arrive, carrying the previous figures), so only a total that differs
from the previous one is recorded. A total whose `total_tokens` is not input + output, or
that went down (Codex rewrites it when the context window fills), is not a total: it
becomes a `native_usage_reset` gap instead. `token_usage_record` lines (0.171) are
per-call figures, not totals, and are ignored. Both the 0.125 and 0.171 shapes are read
(the latter adds `ordinal` and `cache_write_input_tokens`); a torn last line is skipped.

A rollout is the agent's to write (SPEC §11): each line goes through the bounded JSON
reader, and a line over its limits (nested deeper than 64, a non-finite number, an
integer beyond 64 bits) is skipped and counted in `refused` by the rule it broke.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from trialledger.adapters.sandbox.agentfiles import ROLLOUT_LINE_LIMIT
from trialledger.core.boundedjson import UnsafeJSON, bounded_loads
from trialledger.core.usage import token_count

# The file reader skips lines over ROLLOUT_LINE_LIMIT bytes (SPEC §11); decoding may turn
# each invalid byte of one into a 3-byte U+FFFD.
TEXT_LIMIT = 3 * ROLLOUT_LINE_LIMIT
NOT_COUNTS = "with a usage record whose counts are not counts (integers up to 10**12)"
FIELDS = ("input_tokens", "cached_input_tokens", "output_tokens", "reasoning_output_tokens",
          "total_tokens")


def _counts(raw: Any) -> dict[str, int] | None:
    """The five counts of a usage record (a missing one 0), or None unless each is a
    count a model could report (`token_count`: up to a trillion)."""
    if not isinstance(raw, dict):
        return None
    counts = {name: token_count(raw.get(name, 0)) for name in FIELDS}
    known = {name: count for name, count in counts.items() if count is not None}
    return known if len(known) == len(FIELDS) else None


def _token_counts(lines: Iterable[str], refused: Counter[str]
                  ) -> Iterator[tuple[str, dict[str, Any]]]:
    for line in lines:
        try:
            record = bounded_loads(line, limit=TEXT_LIMIT)
        except UnsafeJSON as error:
            if not error.malformed:  # a torn line (Codex flushes each; the last may be cut)
                refused[error.rule] += 1  # is no news; a line over the limits is the agent's
            continue
        payload = record.get("payload") if isinstance(record, dict) else None
        if (isinstance(payload, dict) and record.get("type") == "event_msg"
                and payload.get("type") == "token_count"
                and isinstance(payload.get("info"), dict)):
            yield str(record.get("timestamp", "")), payload["info"]


def iter_usage_events(lines: Iterable[str], *, at: str, refused: Counter[str] | None = None
                      ) -> Iterator[dict[str, Any]]:
    """The `usage.native` (and `gap.recorded`) events of a rollout's lines, one at a time;
    `refused` counts the lines over the reader's limits by the rule they broke."""
    previous: dict[str, int] | None = None
    refused = Counter() if refused is None else refused
    for _, info in _token_counts(lines, refused):
        total = _counts(info.get("total_token_usage"))
        if total is None and isinstance(info.get("total_token_usage"), dict):
            refused[NOT_COUNTS] += 1
        if total is None or total == previous:
            continue
        consistent = total["total_tokens"] == total["input_tokens"] + total["output_tokens"]
        if not consistent or (previous and total["total_tokens"] < previous["total_tokens"]):
            yield {"type": "gap.recorded", "at": at, "data": {
                "code": "native_usage_reset",
                "detail": f"rollout total {total['total_tokens']} replaced the running total"}}
        else:
            yield {"type": "usage.native", "at": at, "data": {
                "total": total, "last": _counts(info.get("last_token_usage"))}}
        previous = total


def usage_events(lines: Iterable[str], *, at: str, refused: Counter[str] | None = None
                 ) -> list[dict[str, Any]]:
    """The `usage.native` (and `gap.recorded`) events of one rollout's lines, stamped `at`."""
    return list(iter_usage_events(lines, at=at, refused=refused))


def rollout_files(codex_home: Path) -> list[Path]:
    """Every rollout under a CODEX_HOME, oldest first (`.jsonl.zst` ones are listed too)."""
    sessions = codex_home / "sessions"
    found = [*sessions.rglob("rollout-*.jsonl"), *sessions.rglob("rollout-*.jsonl.zst")]
    return sorted(found)
