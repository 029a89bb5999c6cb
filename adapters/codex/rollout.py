"""Codex session rollouts → `usage.native` events (SPEC §2.3).

A rollout (`$CODEX_HOME/sessions/YYYY/MM/DD/rollout-*.jsonl`) carries `token_count` events
whose `info.total_token_usage` is the session's running total. They repeat (one fires when
rate-limit headers arrive, carrying the previous figures), so only a total that differs
from the previous one is recorded. A total whose `total_tokens` is not input + output, or
that went down (Codex rewrites it when the context window fills), is not a total: it
becomes a `native_usage_reset` gap instead. `token_usage_record` lines (0.171) are
per-call figures, not totals, and are ignored. Both the 0.125 and 0.171 shapes are read
(the latter adds `ordinal` and `cache_write_input_tokens`); a torn last line is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

FIELDS = ("input_tokens", "cached_input_tokens", "output_tokens", "reasoning_output_tokens",
          "total_tokens")


def _counts(raw: Any) -> dict[str, int] | None:
    if not isinstance(raw, dict):
        return None
    counts = {name: raw.get(name, 0) for name in FIELDS}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for v in counts.values()):
        return None
    return counts


def _token_counts(lines: Iterable[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn line (Codex flushes each line; the last may be cut)
        payload = record.get("payload") if isinstance(record, dict) else None
        if (isinstance(payload, dict) and record.get("type") == "event_msg"
                and payload.get("type") == "token_count"
                and isinstance(payload.get("info"), dict)):
            yield str(record.get("timestamp", "")), payload["info"]


def iter_usage_events(lines: Iterable[str], *, at: str) -> Iterator[dict[str, Any]]:
    """The `usage.native` (and `gap.recorded`) events of a rollout's lines, one at a time."""
    previous: dict[str, int] | None = None
    for _, info in _token_counts(lines):
        total = _counts(info.get("total_token_usage"))
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


def usage_events(lines: Iterable[str], *, at: str) -> list[dict[str, Any]]:
    """The `usage.native` (and `gap.recorded`) events of one rollout's lines, stamped `at`."""
    return list(iter_usage_events(lines, at=at))


def rollout_files(codex_home: Path) -> list[Path]:
    """Every rollout under a CODEX_HOME, oldest first (`.jsonl.zst` ones are listed too)."""
    sessions = codex_home / "sessions"
    found = [*sessions.rglob("rollout-*.jsonl"), *sessions.rglob("rollout-*.jsonl.zst")]
    return sorted(found)
