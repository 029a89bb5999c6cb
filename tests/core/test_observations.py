"""SPEC §9: the observation snapshot from the 0.125-shaped example stream of codex-formats §1.6."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sandbox.test_agent_json import json_values
from tests.scenarios import LogBuilder
from trialledger.adapters.console.session import show_session
from trialledger.adapters.view.session import timeline
from trialledger.core import SessionView, replay
from trialledger.core.observations import TOOL_ITEMS, ToolCall

EXAMPLE = (Path(__file__).parents[1] / "data" / "codex-0.125-example.jsonl").read_text(
    encoding="utf-8"
)


def _view() -> SessionView:
    builder = LogBuilder(instruction="Fix the failing lexer test").launched()
    return replay(builder.codex(EXAMPLE.splitlines()).finish(0).events)


def test_conversation_is_instruction_then_reasoning_and_messages_in_order() -> None:
    conversation = _view().observations.invocation.conversation
    assert [(m.role, m.text[:12]) for m in conversation] == [
        ("user", "Fix the fail"), ("reasoning", "**Locating t"), ("assistant", "Fixed the of")]


def test_tool_calls_one_per_item_with_names_arguments_and_outputs() -> None:
    calls = {c.id: c for c in _view().observations.tool_calls}
    assert list(calls) == ["item_1", "item_2", "item_3", "item_4", "ws_08df", "ws_0a1b2c3d4e5f"]
    shell = calls["item_1"]
    assert (shell.name, shell.arguments, shell.exit_code, shell.status) == (
        "exec_command", {"cmd": "/bin/bash -lc 'cargo test -p parser'"}, 101, "failed")
    assert shell.output.startswith("running 12 tests")
    assert shell.started_at is not None and shell.completed_at is not None
    mcp = calls["item_3"]
    assert (mcp.name, mcp.arguments, mcp.output, mcp.status) == (
        "search", {"q": "utf8 boundary"}, "3 results", "completed")
    assert (calls["item_2"].name, calls["item_2"].arguments["changes"][0]["kind"]) == (
        "apply_patch", "update")
    plan = calls["item_4"]
    assert plan.name == "update_plan" and plan.arguments["items"][1]["completed"] is True
    # the web_search line with two `id` keys: the last (ws_…) wins, as JSON parsers do
    started_only = calls["ws_08df"]
    assert (started_only.name, started_only.status, started_only.completed_at) == (
        "web_search", "incomplete", None)
    assert calls["ws_0a1b2c3d4e5f"].arguments == {"query": "rust char_indices boundary"}


def test_a_tool_completed_without_start_is_a_gap() -> None:
    gaps = [(g.code, g.detail) for g in _view().observations.gaps]
    assert ("tool_start_unavailable", "item ws_0a1b2c3d4e5f completed with no item.started") in gaps
    assert len([c for c, _ in gaps if c == "tool_start_unavailable"]) == 1


def test_failed_mcp_call_reports_its_error_message() -> None:
    line = ('{"type":"item.completed","item":{"id":"item_9","type":"mcp_tool_call","server":"d",'
            '"tool":"fetch","arguments":{},"result":null,"error":{"message":"tool timed out"},'
            '"status":"failed"}}')
    builder = LogBuilder().launched().codex(['{"type":"turn.started"}', line])
    (call,) = replay(builder.events).observations.tool_calls
    assert (call.name, call.output, call.status) == ("fetch", "tool timed out", "failed")


def test_status_is_incomplete_while_undecided() -> None:
    builder = LogBuilder().launched().codex(EXAMPLE.splitlines()[:3])
    assert replay(builder.events).observations.invocation.status == "incomplete"
    assert _view().observations.invocation.status == "completed"


# An item as a compromised Codex may print it: any JSON in each field that is read, and
# an MCP call's result in its own shape with any JSON in its blocks (and any JSON for it).
def _or_any(shape: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return shape | json_values(2)


ITEM_FIELDS = ("id", "command", "aggregated_output", "exit_code", "status", "tool", "arguments",
               "changes", "query", "items", "text", "message", "result", "error")
text_blocks = st.lists(_or_any(st.fixed_dictionaries(
    {"type": _or_any(st.just("text"))}, optional={"text": json_values(2)})), max_size=3)


def _items(kind: st.SearchStrategy[Any], **shaped: st.SearchStrategy[Any]
           ) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"type": kind, **shaped}, optional={
        key: json_values(3) for key in ITEM_FIELDS if key not in shaped})


hostile_items = st.one_of(
    _items(_or_any(st.sampled_from([*TOOL_ITEMS, "agent_message", "reasoning", "error"]))),
    _items(st.just("mcp_tool_call"),
           result=_or_any(st.fixed_dictionaries({"content": _or_any(text_blocks)})),
           error=_or_any(st.fixed_dictionaries({"message": json_values(2)}))))
item_events = st.sampled_from(["item.started", "item.updated", "item.completed"])


@settings(max_examples=300, deadline=None)
@given(items=st.lists(st.tuples(item_events, hostile_items), min_size=1, max_size=6))
def test_a_tool_call_holds_what_validating_its_fields_would(
        items: list[tuple[str, dict[str, Any]]]) -> None:
    """Whatever the items hold (lists and objects where names are expected too), the log
    folds and is shown; and the view and its tool calls, built without validation (a long
    session has thousands), each equal, and dump as, what their fields validate to."""
    lines = [json.dumps({"type": kind, "item": item}) for kind, item in items]
    view = replay(LogBuilder().launched().codex(['{"type":"turn.started"}', *lines])
                  .finish(0).events)
    assert view.decision is not None
    show_session(view)  # and both readers of it show it: `show` and the view's timeline
    assert len(timeline(view)) == len(view.events)
    validated_view = SessionView.model_validate(dict(view.__dict__))  # built as well
    assert view == validated_view and view.model_dump_json() == validated_view.model_dump_json()
    for call in view.observations.tool_calls:
        validated = ToolCall.model_validate(dict(call.__dict__))
        assert call == validated
        assert call.model_dump_json() == validated.model_dump_json()
        assert call.model_fields_set == validated.model_fields_set


codex_lines = st.fixed_dictionaries(
    {"type": st.sampled_from(["thread.started", "turn.started", "turn.completed", "turn.failed",
                              "item.started", "item.updated", "item.completed", "error"])},
    optional={"thread_id": json_values(1), "message": json_values(1), "item": hostile_items,
              "usage": _or_any(st.dictionaries(st.sampled_from(
                  ["input_tokens", "cached_input_tokens", "output_tokens",
                   "reasoning_output_tokens"]), json_values(1))),
              "error": _or_any(st.fixed_dictionaries({"message": json_values(1)}))})


@settings(max_examples=200, deadline=None)
@given(objects=st.lists(codex_lines, min_size=1, max_size=8), code=st.sampled_from([0, 1, None]))
def test_whatever_codex_prints_folds_decides_and_is_shown(
        objects: list[dict[str, Any]], code: int | None) -> None:
    """Every type Codex prints, each field any JSON: each line becomes its event or
    `codex.unknown`, and the log folds to a decision that `show` and the view can show."""
    lines = [json.dumps(obj) for obj in objects]
    view = replay(LogBuilder().launched().codex(lines).finish(code).events)
    assert view.decision is not None
    show_session(view)
    assert len(timeline(view)) == len(view.events)
