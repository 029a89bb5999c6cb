"""Projection rows (the SPEC §10 tables behind the analyst views), from a session's view.

Every row is a function of the log alone, so `Ledger.rebuild_projections()` reproduces
exactly what the appends wrote.
"""

from __future__ import annotations

from typing import Any

from core import Decision, SessionSeeded, SessionView

Row = dict[str, Any]
PROJECTION_TABLES = ("sessions", "decision_log", "tool_calls", "gaps", "rewards")


def session_row(view: SessionView, *, head_hash: str) -> Row:
    """The `sessions` row."""
    seed = view.events[0]
    assert isinstance(seed, SessionSeeded)
    data = seed.data
    closed = next((e for e in view.events if e.type == "session.closed"), None)
    return {
        "session_id": view.session_id,
        "trial_id": data.trial_id,
        "attempt": data.attempt,
        "retry_of": data.retry_of,
        "task": data.task,
        "agent_name": data.agent.name,
        "agent_version": data.agent.version,
        "model": data.model,
        "runner_id": data.runner_id,
        "state": view.state,
        "outcome": view.outcome,
        "close_reason": closed.data.reason if closed else None,  # type: ignore[union-attr]
        "created_at": seed.at,
        "closed_at": closed.at if closed else None,
        "head_seq": len(view.events),
        "head_hash": head_hash,
    }


def decision_row(session_id: str, seq: int, at: str, decision: Decision) -> Row:
    """One `decision_log` row (the `decisions` and `outcomes` views add the outcome)."""
    usage = decision.usage
    cause = decision.cause
    return {
        "session_id": session_id,
        "seq": seq,
        "policy": decision.policy,
        "rule": decision.rule,
        "action": decision.action,
        "status": decision.status,
        "http_status": decision.http_status,
        "error": decision.error,
        "cause_kind": cause.kind if cause else None,
        "cause_message": cause.message if cause else None,
        "status_code": cause.status_code if cause else None,
        "incomplete_reason": decision.incomplete_reason,
        "reward_valid": decision.reward_valid,
        "input_tokens": usage.input_tokens if usage else None,
        "cached_input_tokens": usage.cached_input_tokens if usage else None,
        "output_tokens": usage.output_tokens if usage else None,
        "reasoning_output_tokens": usage.reasoning_output_tokens if usage else None,
        "total_tokens": usage.total_tokens if usage else None,
        "decided_at": at,
    }


def projection_rows(view: SessionView, *, head_hash: str) -> dict[str, list[Row]]:
    """Every projection row of one session, by table."""
    sid = view.session_id
    return {
        "sessions": [session_row(view, head_hash=head_hash)],
        "decision_log": [
            decision_row(sid, e.seq or 0, e.at, e.data)  # type: ignore[arg-type]
            for e in view.events
            if e.type == "outcome.decided"
        ],
        "tool_calls": [
            {"session_id": sid, "item_id": c.id, "name": c.name, "kind": c.kind,
             "status": c.status, "started_at": c.started_at, "completed_at": c.completed_at}
            for c in view.observations.tool_calls
        ],
        "gaps": [
            {"session_id": sid, "code": g.code, "detail": g.detail}
            for g in view.observations.gaps
        ],
        "rewards": [
            {"session_id": sid, "name": name, "value": value}
            for name, value in (view.rewards or {}).items()
        ],
    }
