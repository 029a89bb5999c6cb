"""Why a session passed, failed or was left unscored (docs/SPEC.md §10, §13), in one place
for `show`, the view's pages and its lists: its **result** (`pass`: scored, its headline
reward ≥ 1; `fail`: scored below 1; `unscored`), a **reason** in words and a short
**label** for a grid cell.

Worked out from an `Ending`: the few facts of a session's log that the fold
(`replay.why_unscored`) and the store's projections (`sessions`, `outcomes`, `rewards`,
the `verification.failed` events) both give, so a page listing a thousand sessions says
what `show` says without folding any of them.

>>> e = Ending(outcome="verify", action="verify", rule="completed", reward_valid=True,
...            rewards={"reward": 0.0}, verifier_said="expected 4, got 5")
>>> result(e), label(e), reason(e)
('fail', '0.00', 'reward 0 · the verifier said: expected 4, got 5')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Result = Literal["pass", "fail", "unscored"]
RESULTS: tuple[Result, ...] = ("pass", "fail", "unscored")
LABEL_CHARS = 20  # a grid cell's label is cut here (its title says it whole)


@dataclass(frozen=True, slots=True)
class Failure:
    """A `verification.failed`: where in the log, its reason (`no_reward`, `bad_reward`,
    `timeout`, `error`) and its detail."""

    seq: int | None
    reason: str
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Ending:
    """How a session ended, as far as its result and its reason need: the outcome, the
    state, the last decision's fields (none: no decision), the rewards recorded, the
    failed verifications, the close reason and the last line the verifier printed."""

    outcome: str
    state: str | None = None
    action: str | None = None
    rule: str | None = None
    status: str | None = None
    cause_kind: str | None = None
    cause_message: str | None = None
    error: str | None = None
    reward_valid: bool = False
    rewards: Mapping[str, float] | None = None
    failures: Sequence[Failure] = ()
    closed: str | None = None
    verifier_said: str | None = None


def scored(e: Ending) -> bool:
    """Verified with a valid reward: what a job's figures count (SPEC §13)."""
    return e.outcome == "verify" and e.action is not None and e.reward_valid


def headline(rewards: Mapping[str, float] | None) -> float | None:
    """The reward a result is judged by: `reward`'s, else the first name's, 0 for `{}`."""
    if rewards is None:
        return None
    if "reward" in rewards:
        return float(rewards["reward"])
    return float(rewards[min(rewards)]) if rewards else 0.0


def result(e: Ending) -> Result:
    """`pass`, `fail` or `unscored`."""
    if not scored(e):
        return "unscored"
    value = headline(e.rewards)
    return "pass" if value is not None and value >= 1 else "fail"


def failed_lines(e: Ending) -> list[str]:
    """Each failed verification in words (`show` prints them)."""
    return [f"verification failed at seq {f.seq}: {f.reason}"
            f"{': ' + f.detail if f.detail else ''}" for f in e.failures]


def unscored_why(e: Ending) -> str | None:
    """What left the session unscored (None when it is scored)."""
    if scored(e):
        return None
    if e.action is None or e.action == "probe":
        return (f"closed {e.closed} before a decision" if e.closed
                else f"no decision yet (state {e.state})")
    if e.action == "retry":
        message = e.cause_message
        cause = (f", cause {e.cause_kind}{': ' + message if message else ''}"
                 if e.cause_kind else "")
        error = f", error: {e.error}" if e.error and e.error != message else ""
        return f"decided retry by rule {e.rule} (status {e.status}{cause}{error})"
    if e.failures:
        return f"no reward: the verification failed ({e.failures[-1].reason})"
    if e.outcome == "verify":
        return f"the reward is not valid (rule {e.rule})"
    return (f"decided verify by rule {e.rule}, but no verification was recorded"
            f"{' (closed ' + e.closed + ')' if e.closed else ''}")


def unscored_lines(e: Ending) -> list[str]:
    """`show`'s lines of why it did not score: each failed verification, then (unscored)
    an `unscored:` line; nothing for a scored session without a failed verification."""
    why = unscored_why(e)
    return [*failed_lines(e), *([] if why is None else [f"unscored: {why}"])]


def reason(e: Ending) -> str:
    """One line: why it did not pass (empty for a pass)."""
    why = unscored_why(e)
    if why is not None:
        last = e.failures[-1] if e.failures else None
        if last is not None and last.detail and why.startswith("no reward"):
            return f"{last.reason}: {last.detail}"
        return why
    if result(e) == "pass":
        return ""
    said = f" · the verifier said: {e.verifier_said}" if e.verifier_said else ""
    return f"reward {headline(e.rewards):g}{said}"


def label(e: Ending) -> str:
    """A grid cell's few characters: the reward when scored, else what left it unscored
    (a failed verification's reason, the retry's cause, how it was closed)."""
    if scored(e):
        return " ".join(f"{v:.2f}" for v in (e.rewards or {}).values()) or "0.00"
    if e.failures:
        text = e.failures[-1].reason
    elif e.action == "retry":
        text = f"retry {e.cause_kind or e.rule}"
    elif e.action is None or e.action == "probe":
        text = e.closed or "pending"
    elif e.outcome == "verify":
        text = "invalid reward"
    else:
        text = "unverified"
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


def last_line(text: str | None) -> str | None:
    """The last line of a verifier's output with something on it (None: nothing)."""
    for line in reversed((text or "").splitlines()):
        if line.strip():
            return line.strip()
    return None
