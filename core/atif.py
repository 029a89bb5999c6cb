"""A session as an ATIF trajectory (docs/SPEC.md §18): Harbor's Agent Trajectory
Interchange Format, the `agent/trajectory.json` of a Harbor trial folder.

Built from the session's events only (a pure fold; what the store holds is already
scrubbed, SPEC §7): the instruction is the first, `user` step; each agent message an
`agent` step carrying the reasoning that came before it; each tool call (Codex's
`command_execution`, `mcp_tool_call`, …) an `agent` step with its arguments and, as its
observation, its output; a Codex error item or a failed turn a `system` step. Each model
call the proxy recorded gives its token counts to the first agent step it produced (a
call that produced none, a refused or failed one, is an agent step of its own with an
empty message); a session without the proxy's calls gives each turn's counts to its last
agent step. `final_metrics` are the session's usage (SPEC §4). The schema version is the
one Harbor's Codex agent writes (`agents/installed/codex.py`).
"""

from __future__ import annotations

import json
from typing import Any

from trialledger.core.events import ITEM_EVENTS, SessionSeeded, Usage
from trialledger.core.observations import TOOL_ITEMS
from trialledger.core.replay import SessionView

SCHEMA_VERSION = "ATIF-v1.7"


def _metrics(usage: Usage | dict[str, Any] | None) -> dict[str, Any] | None:
    """ATIF's per-step metrics from a usage (ours or Codex's turn usage): cached ⊂ prompt."""
    if usage is None:
        return None
    u = usage.model_dump() if isinstance(usage, Usage) else usage
    metrics: dict[str, Any] = {}
    for ours, theirs in (("input_tokens", "prompt_tokens"),
                         ("output_tokens", "completion_tokens"),
                         ("cached_input_tokens", "cached_tokens")):
        value = u.get(ours)
        if isinstance(value, int) and not isinstance(value, bool):
            metrics[theirs] = value
    reasoning = u.get("reasoning_output_tokens")
    if isinstance(reasoning, int) and not isinstance(reasoning, bool):
        metrics["extra"] = {"reasoning_output_tokens": reasoning}
    return metrics or None


def _text(value: Any) -> str | None:
    """An observation's content: text as it is, anything else as JSON."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


class _Steps:
    """The steps being built, with what waits for the next agent step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.reasoning: list[str] = []
        self.call: dict[str, Any] | None = None  # the model call whose counts are unplaced
        self.turn_start = 0  # index of the first step of the current turn

    def add(self, step: dict[str, Any]) -> dict[str, Any]:
        step = {"step_id": len(self.steps) + 1, **step}
        self.steps.append(step)
        return step

    def agent(self, at: str, message: str, **fields: Any) -> dict[str, Any]:
        """An agent step, given the pending reasoning and model call's counts."""
        step: dict[str, Any] = {"timestamp": at, "source": "agent", "message": message}
        if self.call is not None:
            if self.call.get("model"):
                step["model_name"] = self.call["model"]
            if self.call.get("metrics"):
                step["metrics"] = self.call["metrics"]
            step["llm_call_count"] = 1
            self.call = None
        if self.reasoning:
            step["reasoning_content"] = "\n".join(self.reasoning)
            self.reasoning = []
        return self.add({**step, **fields})

    def unplaced_call(self) -> None:
        """A model call that produced no step becomes an empty agent step of its own."""
        if self.call is not None:
            extra = self.call["extra"]
            self.agent(self.call["at"], "", extra={"model_call": extra})

    def system(self, at: str, message: str) -> None:
        self.add({"timestamp": at, "source": "system", "message": message})


def _tool_step(steps: _Steps, at: str, item_id: str, item: dict[str, Any], *,
               completed: bool) -> None:
    name, arguments, output = TOOL_ITEMS[str(item.get("type"))]
    args = arguments(item)
    call = {"tool_call_id": item_id, "function_name": name(item),
            "arguments": args if isinstance(args, dict) else {"value": args}}
    extra: dict[str, Any] = {"kind": str(item.get("type")),
                             "status": item.get("status") if completed else "incomplete"}
    if isinstance(item.get("exit_code"), int):
        extra["exit_code"] = item["exit_code"]
    fields: dict[str, Any] = {"tool_calls": [call], "extra": extra}
    if completed:
        fields["observation"] = {"results": [{"source_call_id": item_id,
                                              "content": _text(output(item))}]}
    steps.agent(at, "", **fields)


def _turn_usage(steps: _Steps, at: str, usage: Any) -> None:
    """A turn's counts (no proxy calls recorded) on the turn's last agent step."""
    metrics = _metrics(usage if isinstance(usage, dict) else None)
    if metrics is None:
        return
    for step in reversed(steps.steps[steps.turn_start:]):
        if step["source"] == "agent":
            if "metrics" not in step:
                step["metrics"] = metrics
            return
    steps.agent(at, "", metrics=metrics)


def trajectory(view: SessionView) -> dict[str, Any]:
    """The session as an ATIF trajectory (a JSON object; `Trajectory.model_validate` of
    Harbor's models accepts it)."""
    events = view.events
    first = events[0]
    if not isinstance(first, SessionSeeded):  # replay refuses a log that opens otherwise
        raise TypeError("a session's log opens with session.seeded")
    seed = first.data
    steps = _Steps()
    steps.add({"timestamp": events[0].at, "source": "user", "message": seed.instruction})
    proxied = any(e.type == "model.call" for e in events)
    open_tools: dict[str, tuple[str, dict[str, Any]]] = {}
    for event in events[1:]:
        if isinstance(event, ITEM_EVENTS):
            item: dict[str, Any] = event.data.item
            kind, item_id = item.get("type"), str(item.get("id"))
            if isinstance(kind, str) and kind in TOOL_ITEMS:
                if event.type == "item.completed":
                    open_tools.pop(item_id, None)
                    _tool_step(steps, event.at, item_id, item, completed=True)
                else:
                    open_tools[item_id] = (event.at, item)
            elif event.type != "item.completed":
                continue
            elif kind == "agent_message" and isinstance(item.get("text"), str):
                steps.agent(event.at, item["text"])
            elif kind == "reasoning" and isinstance(item.get("text"), str):
                steps.reasoning.append(item["text"])
            elif kind == "error" and isinstance(item.get("message"), str):
                steps.system(event.at, item["message"])
        elif event.type == "model.call":
            steps.unplaced_call()
            data = event.data
            steps.call = {"at": event.at, "model": data.model, "metrics": _metrics(data.usage),
                          "extra": {"call": data.call, "http_status": data.http_status,
                                    "error": data.error, "completed": data.completed}}
        elif event.type == "turn.started":
            steps.turn_start = len(steps.steps)
        elif event.type == "turn.completed" and not proxied:
            _turn_usage(steps, event.at, event.data.usage)
        elif event.type == "turn.failed":
            error = event.data.error or {}
            steps.system(event.at, f"turn failed: {error.get('message', '')}")
    steps.unplaced_call()
    for at, item in open_tools.values():  # started, never completed (the run was cut)
        _tool_step(steps, at, str(item.get("id")), item, completed=False)
    agent: dict[str, Any] = {"name": seed.agent.name, "version": seed.agent.version}
    if seed.model:
        agent["model_name"] = seed.model
    final: dict[str, Any] = {"total_steps": len(steps.steps)}
    if view.usage is not None:
        u = view.usage
        final.update(total_prompt_tokens=u.input_tokens, total_completion_tokens=u.output_tokens,
                     extra={"reasoning_output_tokens": u.reasoning_output_tokens,
                            "total_tokens": u.total_tokens})
        if u.cached_input_tokens is not None:
            final["total_cached_tokens"] = u.cached_input_tokens
    return {"schema_version": SCHEMA_VERSION, "session_id": view.session_id, "agent": agent,
            "steps": steps.steps, "final_metrics": final,
            "extra": {"task": seed.task, "trial_id": seed.trial_id, "attempt": seed.attempt,
                      "outcome": view.outcome}}
