"""SPEC §4: usage recovery; null means unavailable, never a fabricated zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scenarios import (
    CLEAN,
    HTTP_429,
    KILLED,
    METADATA,
    STREAM_CUT,
    THREAD,
    TOOL_CALL,
    TURN,
    LogBuilder,
    run,
)
from trialledger.core import BadEvent, SessionView, replay
from trialledger.core.events import MAX_TOKENS
from trialledger.store import Ledger


def _gaps(view: SessionView) -> list[str]:
    return [g.code for g in view.observations.gaps]


def test_killed_run_reports_native_totals() -> None:
    builder = LogBuilder(verify_after_agent_error=True).launched().codex(TOOL_CALL[:5])
    builder.native((20, 8, 28), (20, 8, 28)).finish(KILLED)
    view = replay(builder.events)
    assert view.decision is not None and view.decision.action == "probe"
    u = view.decision.usage
    assert u is not None
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (20, 8, 28)
    assert view.usage == u


def test_killed_run_without_native_usage_is_null_not_zero() -> None:
    view = replay(run(TOOL_CALL[:5], KILLED, vaae=True).events)
    assert view.decision is not None and view.decision.usage is None
    assert "partial_model_usage_unavailable" in _gaps(view)


def test_clean_run_reports_turn_completed_total() -> None:
    u = replay(run(CLEAN, 0).events).usage
    assert u is not None
    assert (u.input_tokens, u.cached_input_tokens, u.output_tokens,
            u.reasoning_output_tokens, u.total_tokens) == (12, 2, 10, 3, 22)


def test_zero_cached_and_reasoning_are_unavailable_with_gaps() -> None:
    view = replay(run(TOOL_CALL, 0).events)
    u = view.usage
    assert u is not None and (u.cached_input_tokens, u.reasoning_output_tokens) == (None, None)
    assert u.total_tokens == 30
    assert {"cached_token_usage_unavailable", "reasoning_token_usage_unavailable"} <= set(
        _gaps(view))


def test_provider_refusal_before_any_output_is_a_known_zero() -> None:
    u = replay(run(HTTP_429, 1).events).usage
    assert u is not None and u.total_tokens == 0 and u.cached_input_tokens == 0


def test_no_turn_started_is_a_known_zero() -> None:
    u = replay(run([THREAD], 1).events).usage
    assert u is not None and u.total_tokens == 0


def test_turn_in_flight_without_work_is_null() -> None:
    view = replay(run([THREAD, TURN], KILLED).events)
    assert view.usage is None
    assert "partial_model_usage_unavailable" in _gaps(view)


def test_native_usage_wins_for_every_status() -> None:
    builder = LogBuilder().launched().codex(CLEAN).native((30, 9, 39)).finish(0)
    u = replay(builder.events).usage
    assert u is not None and u.total_tokens == 39


def test_item_started_after_turn_completed_discards_its_usage() -> None:
    lines = [*CLEAN, TOOL_CALL[3]]
    view = replay(run(lines, KILLED).events)
    assert view.usage is None


def test_failed_turn_after_work_is_null_not_zero() -> None:
    view = replay(run(STREAM_CUT, 1).events)  # two agent messages, then turn.failed
    assert view.usage is None
    assert view.decision is not None and view.decision.usage is None
    assert "partial_model_usage_unavailable" in _gaps(view)


def test_warning_items_are_not_work() -> None:
    u = replay(run([THREAD, METADATA, TURN, *HTTP_429[3:]], 1).events).usage
    assert u is not None and u.total_tokens == 0


@settings(max_examples=150, deadline=None)
@given(inputs=st.integers(0, 2**63 - 1), outputs=st.integers(0, 2**63 - 1))
def test_usage_is_never_past_a_trillion_tokens(inputs: int, outputs: int) -> None:
    """What Codex's stream claims may be any 64-bit count; the session's usage is a count
    up to 10**12 or unknown (with its gap), never a sum past what SQL's sums can add."""
    usage = json.dumps({"type": "turn.completed", "usage": {
        "input_tokens": inputs, "cached_input_tokens": 1, "output_tokens": outputs,
        "reasoning_output_tokens": 1}})
    view = replay(LogBuilder().launched().codex([THREAD, TURN, usage]).finish(0).events)
    if inputs + outputs <= MAX_TOKENS:
        assert view.usage is not None and view.usage.total_tokens == inputs + outputs
    else:
        assert view.usage is None and "partial_model_usage_unavailable" in _gaps(view)


@pytest.mark.anyio
async def test_a_count_past_a_trillion_is_refused_on_import(tmp_path: Path) -> None:
    """An event may not hold one (two such sessions overflowed `job show`'s sums)."""
    builder = LogBuilder().launched().codex([THREAD, TURN])
    builder.native((10**12, 1, 10**12 + 1), (10**12, 1, 10**12 + 1)).finish(0)
    async with await Ledger.open(str(tmp_path / "t.db")) as ledger:
        with pytest.raises(BadEvent, match="less than or equal to 1000000000000"):
            await ledger.import_log(builder.events)
        assert await ledger.session_count() == 0
