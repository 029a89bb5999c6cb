"""One session as a person reads it (docs/SPEC.md §10): `show`'s timeline and its
decisions explained, and `run`'s line (or JSON object) per session."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from trialledger.adapters.console.plain import plain
from trialledger.adapters.console.render import out, table
from trialledger.core import explain, why
from trialledger.core.replay import ending, why_unscored


def show_session(view: Any) -> None:
    """`show`: the timeline with each event's time since the start and since the one
    before, the header line, each decision explained, why it did not score (a failed
    verification's reason, what left it unscored), usage, gaps, rewards, what the
    verifier printed and the files it kept; its result (pass, fail, unscored) and why."""
    start = _when(view.events[0].at)
    rows, previous = [], start
    for event in view.events:
        moment = _when(event.at)
        rows.append((event.seq, f"+{(moment - start).total_seconds():.3f}s",
                     f"{(moment - previous).total_seconds():.3f}s", event.type,
                     model_call(event.data) if event.type == "model.call"
                     else brief(event.data.model_dump(mode="json"))))
        previous = moment
    table(["seq", "since start", "step", "type", "data"], rows)
    seed = view.events[0].data
    out.print(plain(f"session {view.session_id}  task {seed.task}  attempt {seed.attempt}  "
                    f"state {view.state}  outcome {view.outcome}"))
    for line in [*explain(view), *why_unscored(view)]:
        out.print(plain(line))
    ended = ending(view)
    reason = why.reason(ended)
    out.print(plain(f"result: {why.result(ended)}{' (' + reason + ')' if reason else ''}"))
    usage = view.usage
    out.print("usage: " + (f"{usage.total_tokens} tokens ({usage.input_tokens} in, "
                           f"{usage.output_tokens} out)" if usage else "unavailable"))
    for gap in view.observations.gaps:
        out.print(plain(f"gap {gap.code}: {brief(gap.detail or '')}"))
    if view.rewards is not None:
        out.print(plain(f"rewards: {view.rewards}"))
    for event in view.events:  # what the verifier printed (schema 2)
        for stream in ("stdout", "stderr"):
            said = getattr(event.data, f"{stream}_tail", None) if event.type.startswith(
                "verification.") else None
            if said:
                out.print(f"verifier {stream} (tail):", highlight=False)
                out.print(plain(said.rstrip("\n")))
    if kept := kept_files(view):
        out.print(f"kept files ({len(kept)}; `trialledger artifacts` reads them):")
        for entry in kept:
            out.print(plain(f"  {entry.path}  {entry.size} bytes"))


def kept_files(view: Any) -> list[Any]:
    """The files the session's verification lists (schema 3; none before)."""
    return [entry for event in view.events if event.type.startswith("verification.")
            for entry in event.data.files]


def model_call(call: Any) -> str:
    """`call 2 POST /v1/responses → 429 (0.31 s)`: what the proxy saw of one model call."""
    answer = str(call.http_status) if call.http_status is not None else "no answer"
    how = ", ".join(part for part in (
        "completed" if call.completed else "not completed", call.error,
        f"{call.usage.total_tokens} tokens" if call.usage else None, call.model) if part)
    took = ""
    if call.ended_at:
        seconds = _when(call.ended_at) - _when(call.started_at)
        took = f" ({seconds.total_seconds():.2f} s)"
    return f"call {call.call} {call.method} {call.path} → {answer}, {how}{took}"


def brief(value: Any, width: int = 90) -> str:
    """`value` (JSON unless a string) on one line of at most `width` characters."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def _when(at: str) -> datetime:
    return datetime.fromisoformat(at.replace("Z", "+00:00"))


def print_outcomes(results: Sequence[Any], *, as_json: bool) -> None:
    """`run`: one line per session, `<id> <outcome>` and its rewards once verified, or
    (`as_json`) one JSON object."""
    for result in results:
        if as_json:
            print(json.dumps(session_summary(result.view)), flush=True)
        else:
            out.print(plain(f"{result.session_id} {result.outcome}"
                            f"{reward_words(result.view)}{step_words(result.view)}"))


def step_words(view: Any) -> str:
    """A step session's step beside its outcome (`  step 1/3 write`); nothing for a
    one-step task's."""
    step = getattr(view.events[0].data, "step", None) if view.events else None
    return "" if step is None else f"  step {step.index}/{step.count} {step.name}"


def print_trial_reward(trial_id: str, strategy: str, rewards: Any, steps: int, *,
                       as_json: bool) -> None:
    """`run` of a multi-step task: the trial's reward by its strategy (docs/SPEC.md §17)."""
    if as_json:
        print(json.dumps({"trial_id": trial_id, "reward_strategy": strategy,
                          "steps": steps, "rewards": rewards}), flush=True)
        return
    said = reward_pairs(rewards) if rewards else "no result"
    out.print(plain(f"trial {trial_id}: {said} ({strategy} over {steps} step(s))"))


def session_summary(view: Any) -> dict[str, Any]:
    """One session of `run --json`: how it ended and why."""
    d = view.decision
    return {"session_id": view.session_id, "outcome": view.outcome,
            "attempt": view.events[0].data.attempt, "rule": d.rule if d else None,
            "cause": d.cause.kind if d and d.cause else None,
            "reward_valid": d.reward_valid if d else None, "rewards": view.rewards,
            "total_tokens": view.usage.total_tokens if view.usage else None}


def reward_words(view: Any) -> str:
    """What `run` says beside a session's outcome: its reward (`reward=0`: the tests
    failed), `no reward` when it was verified without a valid one, nothing otherwise."""
    if view.outcome != "verify":
        return ""
    if not view.rewards:
        return " no reward"
    valid = view.decision is not None and view.decision.reward_valid
    return f" {reward_pairs(view.rewards)}{'' if valid else ' (not valid)'}"


def reward_pairs(rewards: Mapping[str, Any]) -> str:
    """Rewards as `name=value` pairs, numbers in their shortest form."""
    return " ".join(f"{name}={value:g}" if isinstance(value, (int, float)) else
                    f"{name}={value}" for name, value in rewards.items())
