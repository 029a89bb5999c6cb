"""A session's page (docs/SPEC.md §10, §15): its timeline — tool calls with their output,
model calls with status and duration, gaps, each decision explained — the verifier's
output and files, usage, the environment; and its re-derivation under each policy."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trialledger.adapters.session import artifacts
from trialledger.adapters.view.names import slug
from trialledger.adapters.view.pages import NotFound
from trialledger.adapters.view.render import plain_data
from trialledger.adapters.view.store import rows
from trialledger.core import Event, SessionView, explain, replay, why
from trialledger.core.policy import POLICIES
from trialledger.core.replay import ending
from trialledger.store import Ledger, NoSession

PAUSE_S = 30.0  # a step this long between two events is highlighted as a pause
LONG_TEXT = 600  # characters past which a tool's output or an event's data is collapsed
SHOWN_FILE = 64 * 1024  # bytes of a kept file shown on the page
PART_EVENTS = 1000  # events of the timeline per page
FOLDED_EVENTS = 20_000  # events of the views one server keeps folded (~4 KB of memory each)


def _events(view: SessionView) -> list[Any]:
    """The view's events, their data read by type (the union is narrowed by `type`)."""
    return list(view.events)


def _when(at: str) -> datetime:
    return datetime.fromisoformat(at.replace("Z", "+00:00"))


@dataclass(frozen=True, slots=True)
class ToolRow:
    """A tool call's part of a timeline row (its output once the item completed)."""

    id: str
    name: str
    kind: str
    arguments: str
    command: str  # a shell command's own text; any other tool's arguments
    output: str | None
    exit_code: int | None
    status: str
    long: bool


@dataclass(frozen=True, slots=True)
class ModelRow:
    """A `model.call`'s part of a timeline row."""

    call: int
    method: str
    path: str
    status: int | None
    error: str | None
    completed: bool
    duration_ms: int | None
    model: str | None
    tokens: int | None


@dataclass(frozen=True, slots=True)
class Row:
    """One event of the timeline. (Objects, not dicts: a template reads a dict's keys
    only after an attribute lookup fails, which was half of rendering 1,000 rows.)"""

    seq: int | None
    type: str
    since: float
    step: float
    pause: bool
    gap: bool
    explained: str | None
    tool: ToolRow | None = None
    model_call: ModelRow | None = None
    data: str | None = None  # the event's data as JSON, for any other event
    long: bool = False


def _tool_row(event: Event, tools: dict[str, Any]) -> ToolRow | None:
    item = getattr(event.data, "item", None)
    call = tools.get(str(item.get("id"))) if isinstance(item, dict) else None  # as traced
    if call is None:
        return None
    output = call.output if isinstance(call.output, str) or call.output is None \
        else json.dumps(plain_data(call.output), ensure_ascii=False)
    arguments = call.arguments if isinstance(call.arguments, str) \
        else json.dumps(plain_data(call.arguments), ensure_ascii=False)
    cmd = call.arguments.get("cmd") if isinstance(call.arguments, dict) else None
    done = event.type == "item.completed"
    return ToolRow(id=call.id, name=call.name, kind=call.kind, arguments=arguments,
                   command=cmd if isinstance(cmd, str) else arguments,
                   output=output if done else None,
                   exit_code=call.exit_code if done else None,
                   status=call.status if done else "started",
                   long=done and output is not None and (len(output) > LONG_TEXT
                                                         or output.count("\n") > 12))


def _model_row(call: Any) -> ModelRow:
    took = None
    if call.ended_at:
        took = round((_when(call.ended_at) - _when(call.started_at)).total_seconds() * 1000)
    return ModelRow(call=call.call, method=call.method, path=call.path,
                    status=call.http_status, error=call.error, completed=call.completed,
                    duration_ms=took, model=call.model,
                    tokens=call.usage.total_tokens if call.usage else None)


@dataclass(frozen=True, slots=True)
class Said:
    """One entry of the transcript: the instruction, an agent message, its reasoning, a
    tool call (completed, or started and never completed), a model call, an error, a
    decision, or the verifier's word."""

    kind: str  # instruction, message, reasoning, tool, model, error, decision, verifier
    seq: int | None
    text: str | None = None
    tool: ToolRow | None = None
    model_call: ModelRow | None = None
    verification: dict[str, Any] | None = None
    long: bool = False


_SAID_ITEMS = {"agent_message": "message", "reasoning": "reasoning", "error": "error"}


def _said(event: Any, row: Row, tools: dict[str, Any]) -> Said | None:
    """What the transcript shows of one event (its timeline row already built)."""
    kind = event.type
    if row.tool is not None:
        if kind == "item.completed" or (kind == "item.started"
                                        and tools[row.tool.id].completed_at is None):
            return Said("tool", row.seq, tool=row.tool)
        return None
    if row.model_call is not None:
        return Said("model", row.seq, model_call=row.model_call)
    if kind == "item.completed":
        item = event.data.item
        said, text = _SAID_ITEMS.get(str(item.get("type"))), item.get(
            "message" if item.get("type") == "error" else "text")
        if said is None or not isinstance(text, str):
            return None
        return Said(said, row.seq, text=text, long=len(text) > LONG_TEXT)
    if kind == "session.seeded":
        return Said("instruction", row.seq, text=event.data.instruction)
    if kind in ("turn.failed", "error"):
        error = getattr(event.data, "error", None)
        message = error.get("message") if isinstance(error, dict) else getattr(
            event.data, "message", None)
        return Said("error", row.seq, text=f"{kind}: {message or ''}")
    if kind == "outcome.decided":
        return Said("decision", row.seq, text=row.explained)
    if kind.startswith("verification."):
        return Said("verifier", row.seq, verification=_verification(event))
    return None


def timeline(view: SessionView, first: int = 0, count: int | None = None, *,
             explained: Sequence[str] | None = None,
             transcript: list[Said] | None = None) -> list[Row]:
    """One row per event (`count` of them from index `first`): when, the step since the
    one before, what it says (`explained`: `explain(view)`, when the caller has it).
    `transcript`: appended with the same events' entries, in the same walk."""
    tools = {t.id: t for t in view.observations.tool_calls}
    decisions = [e.seq for e in view.events if e.type == "outcome.decided"]
    said = dict(zip(decisions, explain(view) if explained is None else explained,
                    strict=True))
    start = _when(view.events[0].at)
    previous = _when(view.events[max(first - 1, 0)].at)
    found = []
    for event in view.events[first:None if count is None else first + count]:
        moment = _when(event.at)
        step = (moment - previous).total_seconds()
        tool = _tool_row(event, tools) if event.type.startswith("item.") else None
        model_call = _model_row(event.data) if event.type == "model.call" else None
        data = None
        if tool is None and model_call is None:
            data = json.dumps(plain_data(event.data.model_dump(mode="json", exclude_none=True)),
                              ensure_ascii=False)
        row = Row(seq=event.seq, type=event.type, since=(moment - start).total_seconds(),
                  step=step, pause=step >= PAUSE_S, gap=event.type == "gap.recorded",
                  explained=said.get(event.seq), tool=tool, model_call=model_call,
                  data=data, long=data is not None and len(data) > LONG_TEXT)
        found.append(row)
        if transcript is not None and (entry := _said(event, row, tools)) is not None:
            transcript.append(entry)
        previous = moment
    return found


def _files(view: SessionView) -> dict[str, Any]:
    """The kept files the verification lists, read from the artifact folder when it is on
    this machine (checked against their sha256), else where they live."""
    seed = _events(view)[0].data
    folder = artifacts.session_folder(seed.settings.sandbox_logs_dir, view.session_id)
    kept = [f for e in _events(view) if e.type.startswith("verification.")
            for f in e.data.files]
    here = artifacts.on_this_machine(folder, view.session_id)
    listed = []
    for entry in kept:
        shown, refused = None, None
        if here:
            try:
                data = artifacts.read_kept(folder, entry)
                shown = "(binary)" if b"\0" in data[:SHOWN_FILE] else \
                    data[:SHOWN_FILE].decode("utf-8", errors="replace")
            except artifacts.ArtifactRefused as error:
                refused = str(error)
        listed.append({"path": entry.path, "size": entry.size, "sha256": entry.sha256,
                       "content": shown, "refused": refused})
    return {"folder": str(folder), "here": here, "files": listed, "runner": seed.runner_id}


def _verification(e: Any) -> dict[str, Any]:
    return {"type": e.type, "rewards": getattr(e.data, "rewards", None),
            "reason": getattr(e.data, "reason", None), "detail": e.data.detail,
            "stdout": e.data.stdout_tail, "stderr": e.data.stderr_tail}


def _verifications(view: SessionView) -> list[dict[str, Any]]:
    return [_verification(e) for e in _events(view) if e.type.startswith("verification.")]


def _environment(view: SessionView) -> dict[str, Any] | None:
    launched = next((e for e in _events(view) if e.type == "agent.launched"), None)
    if launched is None:
        return None
    d = launched.data
    return {"isolation": d.isolation, "environment": d.environment, "limits": d.limits,
            "identity": d.identity, "workdir": d.workdir, "argv": " ".join(d.argv),
            "env_keys": ", ".join(d.env_keys), "model_proxy": d.model_proxy,
            "runner": d.runner_id}


class Folds:
    """Sessions' views, each folded once (`Ledger.view`) for every page that shows it: a
    session page, its other parts, its re-derivation page. A view is kept under its
    session's head (last seq and hash), read from the store at each request, so a session
    that has grown since is folded again; past FOLDED_EVENTS events in all, the least
    recently shown are let go (the last one shown is kept, however long)."""

    def __init__(self, ledger: Ledger, limit: int = FOLDED_EVENTS) -> None:
        self.ledger, self.limit = ledger, limit
        self._kept: OrderedDict[str, tuple[tuple[int, str], SessionView]] = OrderedDict()

    async def view(self, session_id: str) -> SessionView:
        """The session's view as recorded (`NotFound` for a session the store lacks)."""
        head = await rows(self.ledger, "SELECT head_seq, head_hash FROM sessions "
                          "WHERE session_id = :s", {"s": session_id})
        if not head:
            raise NotFound(f"no session {session_id}")
        key = (int(head[0]["head_seq"]), str(head[0]["head_hash"]))
        kept = self._kept.get(session_id)
        if kept is not None and kept[0] == key:
            self._kept.move_to_end(session_id)
            return kept[1]
        view = await _folded(self.ledger, session_id)
        self._kept.pop(session_id, None)
        if view.events[-1].seq == key[0]:  # (not when appended to since the head was read)
            self._kept[session_id] = (key, view)
            while len(self._kept) > 1 and sum(
                    len(v.events) for _, v in self._kept.values()) > self.limit:
                self._kept.popitem(last=False)
        return view


async def _folded(ledger: Ledger, session_id: str) -> SessionView:
    try:
        return await ledger.view(session_id)
    except NoSession:
        raise NotFound(f"no session {session_id}") from None


async def session(ledger: Ledger, session_id: str, part: int = 1, *,
                  view: SessionView | None = None) -> dict[str, Any]:
    """Everything the session page shows; its timeline in parts of PART_EVENTS events
    (`part` from 1), so a long session's page stays quick to render and to read. `view`:
    the session's, when the caller has it folded (`Folds`)."""
    if view is None:
        view = await _folded(ledger, session_id)
    seed = _events(view)[0].data
    member = await rows(ledger, "SELECT job FROM job_queue WHERE trial_id = :t",
                        {"t": seed.trial_id})
    parts = max(1, -(-len(view.events) // PART_EVENTS))
    if not 1 <= part <= parts:
        raise NotFound(f"session {session_id} has {parts} part(s) of events, not {part}")
    explained = explain(view)
    said: list[Said] = []
    shown = timeline(view, (part - 1) * PART_EVENTS, PART_EVENTS, explained=explained,
                     transcript=said)
    ended = ending(view)
    return {"view": view, "seed": seed, "part": part, "parts": parts,
            "timeline": shown, "transcript": said,
            "result": why.result(ended), "reason": why.reason(ended),
            "why": why.unscored_lines(ended),
            "explained": explained, "verifications": _verifications(view),
            "kept": _files(view), "environment": _environment(view),
            "gaps": view.observations.gaps, "usage": view.usage,
            "job": {"name": member[0]["job"], "slug": slug(member[0]["job"])} if member
            else None}


async def rederived(ledger: Ledger, session_id: str,
                    policies: Sequence[str] | None = None, *,
                    view: SessionView | None = None) -> dict[str, Any]:
    """The session re-derived under each registered policy: its outcome, decision and the
    first decision that differs from the recorded one (as `Ledger.divergences` finds it).
    `view`: the session's as recorded, when the caller has it folded (its events)."""
    if view is not None:
        events: list[Any] = list(view.events)
    else:
        stored = await ledger.events(session_id)
        if not stored:
            raise NotFound(f"no session {session_id}")
        events = [s.event for s in stored]
    own = events[0].data.settings.policy
    found = []
    for name in policies or sorted(POLICIES):
        try:
            view = replay(events, policy=name)
        except Exception as error:  # a registered policy that cannot decide this log
            found.append({"policy": name, "own": name == own, "outcome": None,
                          "decision": None, "explained": [], "diverged": None,
                          "error": f"{type(error).__name__}: {error}"})
            continue
        d = view.diverged_at
        found.append({"policy": name, "own": name == own, "outcome": view.outcome,
                      "error": None, "decision": view.decision, "explained": explain(view),
                      "diverged": None if d is None else {
                          "seq": d.seq,
                          "recorded": f"{d.recorded.rule}/{d.recorded.action}"
                          if d.recorded else "none",
                          "derived": f"{d.derived.rule}/{d.derived.action}"
                          if d.derived else "none"}})
    return {"session_id": session_id, "task": events[0].data.task, "own": own,
            "policies": found}
