"""Usage recovery (SPEC §4): native totals first; never a fabricated zero."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trialledger.core.events import MAX_TOKENS, Event, Gap, Usage, UsageNative

TURN_TYPES = frozenset({"turn.started", "turn.completed", "turn.failed"})
ZERO = Usage(
    input_tokens=0,
    cached_input_tokens=0,
    output_tokens=0,
    reasoning_output_tokens=0,
    total_tokens=0,
)
PARTIAL = Gap(
    code="partial_model_usage_unavailable",
    detail="work happened that no usage record covers",
)


def token_count(value: Any) -> int | None:
    """A token count as reported: an integer from 0 to MAX_TOKENS, else None (unknown)."""
    plausible = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS
    return value if plausible else None


def _positive(usage: dict[str, Any], key: str, gap_code: str) -> tuple[int | None, list[Gap]]:
    value = token_count(usage.get(key))
    if value:
        return value, []
    return None, [Gap(code=gap_code, detail=f"turn.completed reported {key}={usage.get(key)!r}")]


def _from_turn_completed(usage: dict[str, Any] | None) -> tuple[Usage, list[Gap]] | None:
    if usage is None:
        return None
    input_tokens = token_count(usage.get("input_tokens"))
    output_tokens = token_count(usage.get("output_tokens"))
    if input_tokens is None or output_tokens is None or input_tokens + output_tokens > MAX_TOKENS:
        return None
    cached, cached_gaps = _positive(usage, "cached_input_tokens", "cached_token_usage_unavailable")
    reasoning, reasoning_gaps = _positive(
        usage, "reasoning_output_tokens", "reasoning_token_usage_unavailable"
    )
    return (
        Usage(
            input_tokens=input_tokens,
            cached_input_tokens=cached,
            output_tokens=output_tokens,
            reasoning_output_tokens=reasoning,
            total_tokens=input_tokens + output_tokens,
        ),
        cached_gaps + reasoning_gaps,
    )


def recover_usage(events: Sequence[Event]) -> tuple[Usage | None, list[Gap]]:
    """The run's usage and the gaps that explain what is unavailable, from the log alone."""
    native: UsageNative | None = None
    last_turn: Event | None = None
    item_started_after_completion = False
    work_happened = False
    for event in events:
        kind = event.type
        if kind.startswith("item."):  # first: most of a long log
            item = getattr(event.data, "item", {})
            if item.get("type") != "error":
                work_happened = True
            if kind == "item.started":
                item_started_after_completion = True
        elif isinstance(event, UsageNative):
            native = event
        elif kind in TURN_TYPES:
            last_turn = event
            if kind == "turn.completed":
                work_happened = True
                item_started_after_completion = False
    if native is not None:
        return Usage.model_validate(native.data.total.model_dump()), []
    if (
        last_turn is not None
        and last_turn.type == "turn.completed"
        and not item_started_after_completion
    ):
        recovered = _from_turn_completed(last_turn.data.usage)
        if recovered is not None:
            return recovered
    if work_happened:
        return None, [PARTIAL]
    if last_turn is None or last_turn.type == "turn.failed":
        return ZERO, []
    return None, [PARTIAL]
