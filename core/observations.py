"""The observation snapshot (SPEC §9), computed from the log at any moment."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any, Literal, TypeGuard

from pydantic import BaseModel, ConfigDict

from trialledger.core.events import (
    ITEM_EVENTS,
    Decision,
    Event,
    Gap,
    GapRecorded,
    SessionSeeded,
    Usage,
    built,
)
from trialledger.core.policy import Policy


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class Message(_Frozen):
    """One message of the agent's conversation."""

    role: Literal["user", "assistant", "reasoning"]
    text: str


class Invocation(_Frozen):
    """The agent's run: its status and its conversation."""

    status: Literal["completed", "incomplete", "failed"]
    conversation: list[Message]


class ToolCall(_Frozen):
    """One tool call of the agent: what it asked, what came back, how it ended."""

    id: str
    name: str
    kind: str
    arguments: Any
    output: Any
    exit_code: int | None
    status: Literal["completed", "failed", "incomplete"]
    started_at: str | None
    completed_at: str | None


class Observations(_Frozen):
    """What the agent did, computed from the log at any moment (SPEC §9)."""

    source: Literal["codex"] = "codex"
    invocation: Invocation
    tool_calls: list[ToolCall]
    gaps: list[Gap]


def _mcp_output(item: dict[str, Any]) -> Any:
    result, error = item.get("result"), item.get("error")
    if isinstance(result, dict):
        content = result.get("content")
        texts = [
            block.get("text", "")
            for block in (content if isinstance(content, list) else ())
            if isinstance(block, dict) and block.get("type") == "text"
        ]
        return "\n".join(text for text in texts if isinstance(text, str))
    if isinstance(error, dict):
        return error.get("message")
    return None


# item type → (tool name, arguments, output); the name may come from the item itself.
TOOL_ITEMS: dict[str, tuple[Callable[[dict[str, Any]], str], Callable[[dict[str, Any]], Any],
                            Callable[[dict[str, Any]], Any]]] = {
    "command_execution": (
        lambda i: "exec_command",
        lambda i: {"cmd": i.get("command")},
        lambda i: i.get("aggregated_output"),
    ),
    "mcp_tool_call": (
        lambda i: str(i.get("tool") or "mcp_tool_call"),
        lambda i: i.get("arguments"),
        _mcp_output,
    ),
    "file_change": (lambda i: "apply_patch", lambda i: {"changes": i.get("changes")},
                    lambda i: None),
    "web_search": (lambda i: "web_search", lambda i: {"query": i.get("query")}, lambda i: None),
    "todo_list": (lambda i: "update_plan", lambda i: {"items": i.get("items")}, lambda i: None),
}
CONVERSATION_ITEMS = {"agent_message": "assistant", "reasoning": "reasoning"}
FAILED_ITEM_STATUSES = frozenset({"failed", "declined"})


def _is_one_of(value: Any, names: Container[str]) -> TypeGuard[str]:
    """Whether an item's field is one of these names: the item is whatever the agent's
    Codex printed, so the field may be any JSON, a list or an object too (unhashable)."""
    return isinstance(value, str) and value in names


class _ToolTrace:
    __slots__ = ("completed_at", "item", "started_at")

    def __init__(self) -> None:
        self.item: dict[str, Any] = {}
        self.started_at: str | None = None
        self.completed_at: str | None = None

    def call(self, item_id: str) -> ToolCall:
        item = self.item
        name, arguments, output = TOOL_ITEMS[str(item.get("type"))]
        if self.completed_at is None:
            status: Literal["completed", "failed", "incomplete"] = "incomplete"
        elif _is_one_of(item.get("status"), FAILED_ITEM_STATUSES):
            status = "failed"
        else:
            status = "completed"
        code = item.get("exit_code")
        # Each field made here as its type says (`int(code)`: a bool exit code is read as
        # pydantic reads it), so it is not validated again: a long session has thousands.
        return built(ToolCall, {
            "id": item_id,
            "name": name(item),
            "kind": str(item.get("type")),
            "arguments": arguments(item),
            "output": output(item),
            "exit_code": int(code) if isinstance(code, int) else None,
            "status": status,
            "started_at": self.started_at,
            "completed_at": self.completed_at,
        })


class ToolTraces:
    """Tool calls folded one event at a time (the store keeps one per open session)."""

    __slots__ = ("traces",)

    def __init__(self) -> None:
        self.traces: dict[str, _ToolTrace] = {}

    def feed(self, event: Event) -> str | None:
        """Fold one event; return the item id when it touched a tool call."""
        if not isinstance(event, ITEM_EVENTS):
            return None
        item: dict[str, Any] = event.data.item
        if not _is_one_of(item.get("type"), TOOL_ITEMS):
            return None
        item_id = str(item.get("id"))
        trace = self.traces.get(item_id)
        if trace is None:
            trace = self.traces[item_id] = _ToolTrace()
        if trace.completed_at is None:  # a completed item keeps its final content
            trace.item = item
        if event.type == "item.started" and trace.started_at is None:
            trace.started_at = event.at
        elif event.type == "item.completed" and trace.completed_at is None:
            trace.completed_at = event.at
        return item_id

    def call(self, item_id: str) -> ToolCall:
        """The tool call of one item id."""
        return self.traces[item_id].call(item_id)

    def calls(self) -> list[ToolCall]:
        """Every tool call, in order of first appearance."""
        return [trace.call(item_id) for item_id, trace in self.traces.items()]

    def unstarted(self) -> list[str]:
        """Item ids completed with no `item.started`."""
        return [item_id for item_id, t in self.traces.items()
                if t.completed_at is not None and t.started_at is None]


def observe(
    events: Sequence[Event],
    decisions: Sequence[Decision],
    *,
    closed: bool,
    policy: Policy,
    usage: tuple[Usage | None, list[Gap]] | None = None,
) -> Observations:
    """The snapshot of what a log captured: conversation, tool calls and gaps. `usage`:
    `policy.usage_of(events)` when the caller has it (one walk of the log, not two)."""
    conversation: dict[object, Message] = {}
    tools = ToolTraces()
    recorded: list[Gap] = []
    for event in events:
        if isinstance(event, ITEM_EVENTS):  # first: most of a long log
            if tools.feed(event) is not None or event.type != "item.completed":
                continue
            item: dict[str, Any] = event.data.item
            kind, text = item.get("type"), item.get("text")
            if _is_one_of(kind, CONVERSATION_ITEMS) and isinstance(text, str):
                role = CONVERSATION_ITEMS[kind]
                conversation[(kind, str(item.get("id")))] = Message(role=role, text=text)
        elif isinstance(event, SessionSeeded):
            conversation["instruction"] = Message(role="user", text=event.data.instruction)
        elif isinstance(event, GapRecorded):
            recorded.append(event.data)
    decision = decisions[-1] if decisions else None
    return Observations(
        invocation=Invocation(
            status=decision.status if decision else "incomplete",
            conversation=list(conversation.values()),
        ),
        tool_calls=tools.calls(),
        gaps=recorded + derived_gaps(events, decisions, tools, closed=closed, policy=policy,
                                     usage=usage),
    )


def derived_gaps(
    events: Sequence[Event],
    decisions: Sequence[Decision],
    tools: ToolTraces,
    *,
    closed: bool,
    policy: Policy,
    usage: tuple[Usage | None, list[Gap]] | None = None,
) -> list[Gap]:
    """The gaps a log implies (SPEC §9), beyond the recorded ones."""
    gaps: list[Gap] = []
    facts = policy.facts(events)
    for decision in decisions:
        if decision.rule == "startup_failed":
            detail = facts.stderr_tail if facts.stderr_tail is not None else decision.error
            gaps.append(Gap(code="agent_startup_failed", detail=detail))
            break
    final = decisions and decisions[-1].action != "probe"
    if closed and not final:
        gaps.append(Gap(code="agent_activation_interrupted",
                        detail="the session closed before a final decision"))
    gaps += (usage if usage is not None else policy.usage_of(events))[1]
    gaps += policy.warning_gaps(facts)
    gaps += policy.gaps_of(facts)
    gaps += [
        Gap(code="tool_start_unavailable", detail=f"item {item_id} completed with no item.started")
        for item_id in tools.unstarted()
    ]
    for event in events:
        if event.type != "agent.launched":
            continue
        limits = getattr(event.data, "limits", None)
        if limits and not limits.get("enforced"):
            gaps.append(_unenforced(limits))
        if (emulated := _root_emulated(event.data)) is not None:
            gaps.append(emulated)
    return gaps


def _root_emulated(launched: Any) -> Gap | None:
    """`root_emulated` (SPEC §15): an image or rootfs task run in single-id mode, where its
    root is one unprivileged id without capabilities, not a container's root."""
    identity = getattr(launched, "identity", None)
    kind = launched.ran_in.get("kind")
    if not identity or identity.get("mode") != "single" or kind not in ("image", "rootfs"):
        return None
    return Gap(code="root_emulated",
               detail=f"single-id mode: every phase runs as inner {identity.get('user')}, one "
                      f"id without capabilities, not a container's root (apt-get, chown to "
                      f"another user, su and services may fail)")


def _unenforced(limits: dict[str, Any]) -> Gap:
    """`limits_not_enforced`: what was asked for and why the host could not enforce it."""
    requested = limits.get("requested")  # as the runner writes it; an imported log's any JSON
    asked = ", ".join(f"{k}={v}" for k, v in sorted(requested.items()) if v is not None) \
        if isinstance(requested, dict) else ""
    return Gap(code="limits_not_enforced",
               detail=f"{asked}: {limits.get('reason') or 'not enforced'}")
