"""Hypothesis strategies for valid session logs: random walks over the transition table."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tests.scenarios import (
    CAPACITY,
    CLEAN,
    HTTP_429,
    OUTPUT_LIMIT,
    STREAM_CUT,
    TOOL_CALL,
    LogBuilder,
)
from trialledger.adapters.codex.stream import parse_stream_line
from trialledger.core.canonical import session_id_for_seed
from trialledger.core.machine import Session
from trialledger.core.parsing import parse_event

CODEX_LINES = sorted({*CLEAN, *HTTP_429, *STREAM_CUT, *CAPACITY, *TOOL_CALL,
    '{"type":"error","message":"Reconnecting... 1/5 (request timed out)"}',
    '{"type":"error","message":"unexpected status 400 Bad Request: bad"}',
    f'{{"type":"error","message":"{OUTPUT_LIMIT}"}}',
    '{"type":"item.completed","item":{"id":"item_9","type":"error",'
    '"message":"model rerouted: a -> b"}}',
    '{"type":"item.completed","item":{"id":"item_8","type":"reasoning","text":"thinking"}}',
    '{"type":"item.updated","item":{"id":"item_7","type":"todo_list","items":[]}}',
    '{"type":"item.completed","item":{"id":"item_6","type":"mcp_tool_call","server":"docs",'
    '"tool":"search","arguments":{"q":"x"},"result":{"content":[{"type":"text","text":"3"}]},'
    '"error":null,"status":"completed"}}',
    '{"type":"turn.failed","error":{"message":""}}',
    '{"type":"brand.new","x":1}',
    'not json at all',
})
TEXT = st.text(max_size=20)
_COUNTS = {"input_tokens": 5, "cached_input_tokens": 1, "output_tokens": 3,
           "reasoning_output_tokens": 0, "total_tokens": 8}
# One valid data object per event type, for table tests.
SAMPLES: dict[str, dict[str, Any]] = {
    "session.seeded": LogBuilder().events[0]["data"],
    "agent.launched": LogBuilder().launched().events[-1]["data"],
    "agent.stderr": {"tail": "warning: x", "truncated": False},
    "agent.exited": {"return_code": 0, "timed_out": False},
    "cleanup.reported": {"confirmed": True, "error": None},
    "sandbox.lost": {"detail": "gone"},
    "sandbox.probed": {"alive": True, "detail": "ok"},
    "gap.recorded": {"code": "native_usage_reset", "detail": None},
    "archive.copied": {"files": 1, "bytes": 10},
    "archive.skipped": {"reason": "timeout", "detail": None},
    "verification.recorded": {"rewards": {"reward": 1}, "detail": None},
    "verification.failed": {"reason": "no_reward", "detail": None},
    "session.closed": {"reason": "normal"},
    "usage.native": {"total": _COUNTS, "last": None},
    "thread.started": {"thread_id": "t"},
    "turn.started": {},
    "turn.completed": {"usage": {"input_tokens": 1, "output_tokens": 1}},
    "turn.failed": {"error": {"message": "boom"}},
    "item.started": {"item": {"id": "item_1", "type": "command_execution", "command": "ls"}},
    "item.updated": {"item": {"id": "item_2", "type": "todo_list", "items": []}},
    "item.completed": {"item": {"id": "item_3", "type": "agent_message", "text": "hi"}},
    "stream.error": {"message": "Reconnecting... 1/5 (x)"},
    "codex.unknown": {"line": "??"},
    "model.call": {"call": 1, "method": "POST", "path": "/v1/responses",
                   "started_at": "2026-11-29T09:59:59Z", "ended_at": "2026-11-29T10:00:00Z",
                   "http_status": 200, "error": None, "completed": True,
                   "response_id": "resp_1", "model": "m", "usage": None,
                   "output": ["message"]},
    "outcome.decided": {
        "policy": "v1", "rule": "completed", "action": "verify", "status": "completed",
        "http_status": 200, "error": None, "cause": None, "incomplete_reason": None,
        "reward_valid": True, "usage": None,
    },
}


def sample(kind: str, at: str = "2026-11-29T10:00:00Z") -> dict[str, Any]:
    """A valid JSONL event of this type."""
    return {"type": kind, "at": at, "data": SAMPLES[kind]}


def _counts(draw: st.DrawFn) -> dict[str, int]:
    i, o = draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))
    return {"input_tokens": i, "cached_input_tokens": draw(st.integers(0, i)),
            "output_tokens": o, "reasoning_output_tokens": draw(st.integers(0, o)),
            "total_tokens": i + o}


@st.composite
def event_data(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    """Plausible data for an event type."""
    if kind == "agent.launched":
        launched: dict[str, Any] = LogBuilder().launched().events[-1]["data"]
        return launched
    if kind == "gap.recorded":
        return {"code": draw(st.sampled_from(["mcp_server_skipped", "native_usage_reset"])),
                "detail": draw(TEXT)}
    if kind == "turn.started":
        return {}
    if kind == "usage.native":
        return {"total": _counts(draw), "last": None}
    if kind == "agent.stderr":
        return {"tail": draw(TEXT), "truncated": draw(st.booleans())}
    if kind == "agent.exited":
        return {"return_code": draw(st.sampled_from([0, 1, 2, -9, -15, None])),
                "timed_out": draw(st.booleans())}
    if kind == "cleanup.reported":
        return {"confirmed": draw(st.booleans()), "error": draw(st.none() | TEXT)}
    if kind in ("sandbox.lost",):
        return {"detail": draw(TEXT)}
    if kind == "sandbox.probed":
        return {"alive": draw(st.booleans()), "detail": draw(TEXT)}
    if kind == "archive.copied":
        return {"files": draw(st.integers(0, 9)), "bytes": draw(st.integers(0, 10**6))}
    if kind == "archive.skipped":
        return {"reason": draw(st.sampled_from(["timeout", "error", "no_source", "no_time"])),
                "detail": draw(TEXT)}
    if kind == "verification.recorded":
        return {"rewards": {"reward": draw(st.floats(0, 1))}, "detail": None}
    if kind == "verification.failed":
        return {"reason": draw(st.sampled_from(["timeout", "no_reward", "bad_reward", "error"])),
                "detail": draw(TEXT)}
    if kind == "session.closed":
        return {"reason": draw(st.sampled_from(["normal", "cancelled", "recovered"]))}
    if kind == "model.call":
        status = draw(st.sampled_from([200, 429, 500, None]))
        return {**SAMPLES["model.call"], "call": draw(st.integers(1, 5)),
                "http_status": status, "completed": status == 200 and draw(st.booleans()),
                "error": None if status else draw(st.sampled_from(["refused", "client_closed"]))}
    raise AssertionError(kind)


@st.composite
def one_event(draw: st.DrawFn, allowed: list[str]) -> dict[str, Any]:
    """One legal event among the allowed types (Codex ones drawn from real lines)."""
    codex = [t for t in allowed if t.startswith(("thread.", "turn.", "item.", "stream.", "codex."))]
    own = [t for t in allowed if t not in codex]
    pool = own + (["codex"] if codex else [])
    choice = draw(st.sampled_from(pool))
    if choice == "codex":
        record = parse_stream_line(draw(st.sampled_from(CODEX_LINES)))
        if record.type not in allowed:
            record = parse_stream_line('{"type":"turn.started"}')
        return {"type": record.type, "data": record.data}
    return {"type": choice, "data": draw(event_data(choice))}


@st.composite
def session_logs(draw: st.DrawFn, max_events: int = 25) -> list[dict[str, Any]]:
    """A legal harness log (no recorded decisions), as JSONL dicts."""
    vaae = draw(st.booleans())
    seed = LogBuilder(verify_after_agent_error=vaae).events[0]
    session = Session(session_id_for_seed(seed["data"]))
    log = [seed]
    session.apply(parse_event(seed))
    for second in range(1, draw(st.integers(0, max_events)) + 1):
        allowed = session.allowed()
        if not allowed:
            break
        event = draw(one_event(allowed))
        event["at"] = f"2026-11-29T09:{second // 60:02d}:{second % 60:02d}Z"
        session.apply(parse_event(event))
        log.append(event)
    return log
