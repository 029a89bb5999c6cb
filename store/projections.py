"""Projection rows (the SPEC §10 tables behind the analyst views), kept up incrementally.

Every row is a function of the log alone, so `Ledger.rebuild_projections()` reproduces
exactly what the appends wrote:

- `sessions`: one row per session, from its folded state (O(1) per append);
- `decision_log`, `rewards`, `verification_files`: one row per `outcome.decided` / reward /
  file a verification kept (SPEC §15), inserted once;
- `outcomes`: a decided session's last decision with its current outcome, rewritten with
  each append to that session;
- `tool_calls`: one row per tool item, rewritten when an event of that item arrives;
- `gaps`: every recorded gap, plus the gaps the log implies (usage, warnings, startup,
  interruption, tools) **as of the session's latest state change** — recomputed when the
  state changes, so a decided or closed session's gaps are final and an append between
  changes costs nothing. (`SessionView.observations.gaps` is always the whole log's.)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, and_, bindparam, column, delete, insert, table

from trialledger.core import Decision, Event
from trialledger.core.events import GapRecordedData, ModelCall, ModelCallData, SessionSeeded
from trialledger.core.machine import Session
from trialledger.core.observations import ToolTraces, derived_gaps
from trialledger.core.replay import outcome_of
from trialledger.store.engine import driver_marks

Row = dict[str, Any]
SESSION_COLUMNS = ("session_id", "trial_id", "attempt", "retry_of", "task", "agent_name",
                   "agent_version", "model", "runner_id", "state", "outcome", "close_reason",
                   "created_at", "closed_at", "head_seq", "head_hash", "environment_ref",
                   "environment_digest", "step_name", "step_index", "step_count")
MODEL_CALL_COLUMNS = ("session_id", "call", "method", "path", "started_at", "ended_at",
                      "http_status", "error", "completed", "model", "total_tokens")
DECISION_COLUMNS = ("session_id", "seq", "policy", "rule", "action", "status", "http_status",
                    "error", "cause_kind", "cause_message", "status_code", "incomplete_reason",
                    "reward_valid", "input_tokens", "cached_input_tokens", "output_tokens",
                    "reasoning_output_tokens", "total_tokens", "decided_at")
TABLES = {
    "sessions": SESSION_COLUMNS,
    "decision_log": DECISION_COLUMNS,
    "tool_calls": ("session_id", "item_id", "name", "kind", "status", "started_at",
                   "completed_at"),
    "gaps": ("session_id", "code", "detail"),
    "rewards": ("session_id", "name", "value"),
    "model_calls": MODEL_CALL_COLUMNS,
    "verification_files": ("session_id", "path", "size", "sha256"),
    # a session's last decision: the decision's columns less its seq, with the outcome
    "outcomes": ("session_id", "policy", "rule", "action", "outcome",
                 *DECISION_COLUMNS[DECISION_COLUMNS.index("status"):]),
}
TABLE_OF = {name: table(name, *(column(c) for c in columns))  # each projection's SQL table
            for name, columns in TABLES.items()}
SESSION_CHANGES = ("session_id", "state", "outcome", "close_reason", "closed_at", "head_seq",
                   "head_hash", "environment_ref", "environment_digest")


def _update_session(dialect: str) -> str:
    """The `sessions` update in the dialect's driver's own parameter style."""
    *marks, last = driver_marks(dialect, len(SESSION_CHANGES))
    sets = ", ".join(f"{c} = {m}" for c, m in zip(SESSION_CHANGES[1:], marks, strict=True))
    return f"UPDATE sessions SET {sets} WHERE session_id = {last}"


UPDATE_SESSION = {dialect: _update_session(dialect) for dialect in ("sqlite", "postgresql")}


@dataclass
class Projected:
    """What the store keeps beside an open session to update its rows incrementally."""

    tools: ToolTraces = field(default_factory=ToolTraces)
    gaps_at: int = -1  # the transition seq whose implied gaps are in the table


def session_row(session: Session, *, head_hash: str) -> Row:
    """The `sessions` row."""
    seed = session.events[0]
    assert isinstance(seed, SessionSeeded)
    data = seed.data
    return {
        "trial_id": data.trial_id, "attempt": data.attempt,
        "retry_of": data.retry_of, "task": data.task, "agent_name": data.agent.name,
        "agent_version": data.agent.version, "model": data.model, "runner_id": data.runner_id,
        "created_at": seed.at, **session_changes(session, head_hash=head_hash),
        # a multi-step task's step (schema 2 of the seed, SPEC §17); null for one step
        "step_name": data.step.name if data.step else None,
        "step_index": data.step.index if data.step else None,
        "step_count": data.step.count if data.step else None,
    }


def session_changes(session: Session, *, head_hash: str) -> Row:
    """The `sessions` columns an append can change (`SESSION_CHANGES`)."""
    last = session.events[-1]
    closed = last if last.type == "session.closed" else None  # closed is terminal
    return {
        "session_id": session.session_id, "state": session.state,
        "outcome": outcome_of(session), "close_reason": closed.data.reason if closed else None,
        "closed_at": closed.at if closed else None, "head_seq": session.head_seq,
        "head_hash": head_hash, **_environment(session),
    }


def _environment(session: Session) -> Row:
    """The environment a schema-2 `agent.launched` names (null: the host, or none yet)."""
    for event in itertools.islice(session.events, 1, None):  # no copy of the whole log
        if event.type == "agent.launched":
            environment = event.data.ran_in  # an imported log's may hold any JSON
            ref, digest = environment.get("ref"), environment.get("digest")
            return {"environment_ref": ref if isinstance(ref, str) else None,
                    "environment_digest": digest if isinstance(digest, str) else None}
        if event.type != "gap.recorded":  # the launch comes right after the seed's gaps
            break
    return {"environment_ref": None, "environment_digest": None}


def model_call_row(session_id: str, at: str, call: ModelCallData) -> Row:
    """One `model_calls` row."""
    return {"session_id": session_id, "call": call.call, "method": call.method,
            "path": call.path, "started_at": call.started_at, "ended_at": call.ended_at or at,
            "http_status": call.http_status, "error": call.error,
            "completed": int(call.completed), "model": call.model,
            "total_tokens": call.usage.total_tokens if call.usage else None}


def decision_row(session_id: str, seq: int, at: str, decision: Decision) -> Row:
    """One `decision_log` row (the `decisions` and `outcomes` views add the outcome)."""
    usage, cause = decision.usage, decision.cause
    return {
        "session_id": session_id, "seq": seq, "policy": decision.policy, "rule": decision.rule,
        "action": decision.action, "status": decision.status,
        "http_status": decision.http_status, "error": decision.error,
        "cause_kind": cause.kind if cause else None,
        "cause_message": cause.message if cause else None,
        "status_code": cause.status_code if cause else None,
        "incomplete_reason": decision.incomplete_reason,
        "reward_valid": int(decision.reward_valid),  # INTEGER 0/1 on every database
        "input_tokens": usage.input_tokens if usage else None,
        "cached_input_tokens": usage.cached_input_tokens if usage else None,
        "output_tokens": usage.output_tokens if usage else None,
        "reasoning_output_tokens": usage.reasoning_output_tokens if usage else None,
        "total_tokens": usage.total_tokens if usage else None,
        "decided_at": at,
    }


def gaps_as_of_last_change(session: Session) -> list[GapRecordedData]:
    """Every recorded gap, plus the implied ones as of the latest state change."""
    events = session.events
    recorded = [e.data for e in events if e.type == "gap.recorded"]
    prefix = events[: session.transition_seq]
    tools = ToolTraces()
    for event in prefix:
        tools.feed(event)
    decisions = [e.data for e in prefix if e.type == "outcome.decided"]
    closed = bool(prefix) and prefix[-1].type == "session.closed"
    return recorded + derived_gaps(prefix, decisions, tools,
                                   closed=closed, policy=session.policy)


@dataclass
class Changes:
    """The rows one commit writes, gathered across the sessions it touched."""

    new_sessions: list[Row] = field(default_factory=list)
    session_updates: list[Row] = field(default_factory=list)
    inserts: dict[str, list[Row]] = field(default_factory=dict)
    tool_rewrites: list[tuple[str, str]] = field(default_factory=list)
    gap_rewrites: list[str] = field(default_factory=list)
    outcome_rewrites: list[str] = field(default_factory=list)

    def add(self, name: str, rows: Iterable[Row]) -> None:
        self.inserts.setdefault(name, []).extend(rows)

    def session(self, session: Session, projected: Projected, appended: Sequence[Event],
                *, head_hash: str) -> None:
        """Gather the rows that `appended` (just folded into `session`) changes."""
        sid = session.session_id
        if appended and appended[0].type == "session.seeded":
            row = session_row(session, head_hash=head_hash)
            self.new_sessions.append(row)
        else:
            row = session_changes(session, head_hash=head_hash)
            self.session_updates.append(row)
        touched_tools: dict[str, None] = {}
        for event in appended:
            item_id = projected.tools.feed(event)
            if item_id is not None:
                touched_tools[item_id] = None
            elif event.type == "outcome.decided":
                self.add("decision_log", [decision_row(sid, event.seq or 0, event.at,
                                                       event.data)])
            elif isinstance(event, ModelCall):
                self.add("model_calls", [model_call_row(sid, event.at, event.data)])
            elif event.type in ("verification.recorded", "verification.failed"):
                self.add("verification_files", [
                    {"session_id": sid, "path": f.path, "size": f.size, "sha256": f.sha256}
                    for f in event.data.files])
                if event.type == "verification.recorded":
                    self.add("rewards", [{"session_id": sid, "name": name, "value": value}
                                         for name, value in event.data.rewards.items()])
        if session.decisions:
            last = next(e for e in reversed(session.events) if e.type == "outcome.decided")
            self.outcome_rewrites.append(sid)
            outcome = decision_row(sid, 0, last.at, last.data)
            del outcome["seq"]
            self.add("outcomes", [{**outcome, "outcome": row["outcome"]}])
        for item_id in touched_tools:
            self.tool_rewrites.append((sid, item_id))
            self.add("tool_calls", [tool_row(sid, projected.tools, item_id)])
        if session.transition_seq != projected.gaps_at:
            projected.gaps_at = session.transition_seq
            self.gap_rewrites.append(sid)
            self.add("gaps", [gap_row(sid, g) for g in gaps_as_of_last_change(session)])
        elif gaps := [gap_row(sid, e.data) for e in appended if e.type == "gap.recorded"]:
            self.add("gaps", gaps)

    def write(self, conn: Connection, *, sessions_updated: bool = False) -> None:
        """Apply the gathered changes inside the commit's transaction (`sessions_updated`:
        but the session updates, which the caller wrote with its events)."""
        if self.tool_rewrites:
            tools = TABLE_OF["tool_calls"]
            conn.execute(delete(tools).where(and_(
                tools.c.session_id == bindparam("sid"), tools.c.item_id == bindparam("iid"))),
                [{"sid": s, "iid": i} for s, i in self.tool_rewrites])
        if self.gap_rewrites:
            gaps = TABLE_OF["gaps"]
            conn.execute(delete(gaps).where(gaps.c.session_id == bindparam("sid")),
                               [{"sid": s} for s in self.gap_rewrites])
        if self.outcome_rewrites:
            outcomes = TABLE_OF["outcomes"]
            conn.execute(delete(outcomes).where(outcomes.c.session_id == bindparam("sid")),
                               [{"sid": s} for s in self.outcome_rewrites])
        if self.new_sessions:
            conn.execute(insert(TABLE_OF["sessions"]), self.new_sessions)
        if self.session_updates and not sessions_updated:  # driver form: no per-row work
            conn.exec_driver_sql(UPDATE_SESSION[conn.dialect.name], [
                (*(r[c] for c in SESSION_CHANGES[1:]), r["session_id"])
                for r in self.session_updates])
        for name, rows in self.inserts.items():
            if rows:
                conn.execute(insert(TABLE_OF[name]), rows)


def tool_row(session_id: str, tools: ToolTraces, item_id: str) -> Row:
    """One `tool_calls` row."""
    call = tools.call(item_id)
    return {"session_id": session_id, "item_id": call.id, "name": call.name, "kind": call.kind,
            "status": call.status, "started_at": call.started_at,
            "completed_at": call.completed_at}


def gap_row(session_id: str, gap: GapRecordedData) -> Row:
    """One `gaps` row."""
    return {"session_id": session_id, "code": gap.code, "detail": gap.detail}
