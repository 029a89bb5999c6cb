"""Replay (SPEC §3 last paragraph, §10): re-derive a session's outcome from its log.

>>> view = replay([{"type": "session.seeded", "at": "2026-01-01T00:00:00Z", "data": {
...     "trial_id": "t1", "attempt": 1, "runner_id": "r", "task": "demo",
...     "instruction": "say hi", "agent": {"name": "codex", "version": "0.171.0"},
...     "model": "m"}}])
>>> view.state, view.outcome
('seeded', 'pending')
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from trialledger.core.canonical import session_id_for_seed
from trialledger.core.errors import IllegalTransition
from trialledger.core.events import (
    Decision,
    Event,
    OutcomeDecided,
    SessionClosed,
    SessionSeeded,
    Usage,
    built,
)
from trialledger.core.machine import Session, State
from trialledger.core.observations import Observations, observe
from trialledger.core.parsing import parse_events
from trialledger.core.policy import Policy
from trialledger.core.seed import seal_seed
from trialledger.core.why import Ending, Failure, last_line, unscored_lines

Outcome = Literal["retry", "verify", "unverified", "interrupted", "pending"]


class Divergence(BaseModel):
    """The first recorded decision that re-derivation does not reproduce."""

    model_config = ConfigDict(frozen=True)

    seq: int
    recorded: Decision | None  # None: the log records no decision where one was derived
    derived: Decision | None


class SessionView(BaseModel):
    """Everything derived from one session's log (SPEC §10)."""

    model_config = ConfigDict(frozen=True)

    session_id: str
    state: State | None
    outcome: Outcome
    decision: Decision | None
    decisions: list[Decision]
    usage: Usage | None
    rewards: dict[str, float] | None
    observations: Observations
    unapplied: list[Event]
    diverged_at: Divergence | None
    events: list[Event]

    @property
    def close_reason(self) -> str | None:
        """Its `session.closed` reason; None while it is open."""
        last = self.events[-1] if self.events else None
        return last.data.reason if isinstance(last, SessionClosed) else None


def outcome_of(session: Session) -> Outcome:
    """The session's outcome: retry, verify, unverified, interrupted or pending."""
    decided = bool(session.decisions) and session.decisions[-1].action != "probe"
    if session.has("verification.recorded"):
        return "verify"
    if session.decisions and session.decisions[-1].action == "retry":
        return "retry"
    if session.state == "closed":
        return "unverified" if decided else "interrupted"
    return "pending"


def view_of(session: Session, *, unapplied: Iterable[Event] = (),
            diverged_at: Divergence | None = None) -> SessionView:
    """The view of a folded session."""
    events = session.events
    rewards = next(
        (dict(e.data.rewards) for e in events if e.type == "verification.recorded"),
        None,
    )
    usage = session.policy.usage_of(events)
    # Every field is already of its type (the events, decisions and usage are validated
    # models), so the view is not validated again: that re-checked each of the events.
    return built(SessionView, {
        "session_id": session.session_id,
        "state": session.state,
        "outcome": outcome_of(session),
        "decision": session.decisions[-1] if session.decisions else None,
        "decisions": list(session.decisions),
        "usage": usage[0],
        "rewards": rewards,
        "observations": observe(events, session.decisions, closed=session.state == "closed",
                                policy=session.policy, usage=usage),
        "unapplied": list(unapplied),
        "diverged_at": diverged_at,
        "events": list(events),
    })


def _session_id(events: list[Event], first: Mapping[str, Any] | Event | None) -> str:
    """The seed's `session_id`, else uuid5 of the seed's data as the log wrote it (SPEC §2)."""
    seed = events[0] if events else None
    if not isinstance(seed, SessionSeeded):
        kind = seed.type if seed else "nothing"
        raise IllegalTransition(None, kind, ["session.seeded"], "a log starts with its seed")
    if seed.session_id:
        return seed.session_id
    written = first.get("data") if isinstance(first, Mapping) else None
    return session_id_for_seed(written if isinstance(written, Mapping)
                               else seed.data.model_dump(mode="json"))


class Replayer:
    """Folds a recorded log, comparing its recorded decisions with re-derived ones."""

    def __init__(self, session_id: str, policy: str | Policy | None = None, *,
                 default: str | Policy = "v1") -> None:
        self.session = Session(session_id, policy, default=default)
        self.pending: deque[tuple[int, Decision]] = deque()  # derived, not yet compared
        self.unapplied: list[Event] = []
        self.diverged_at: Divergence | None = None

    def feed(self, event: Event) -> None:
        """Apply one recorded event (or compare it, when it is a recorded decision)."""
        if isinstance(event, OutcomeDecided):
            self._compare(event)
            return
        try:
            appended = self.session.apply(event)
        except IllegalTransition:
            if self.diverged_at is None:
                if not self.pending:
                    raise
                # A decision the replay made where the log records none (an evidence-only
                # log under another policy) explains why this event no longer applies.
                seq, derived = self.pending[0]
                self.diverged_at = Divergence(seq=seq, recorded=None, derived=derived)
            self.unapplied.append(event)
            return
        self.pending.extend(
            (e.seq or 0, e.data) for e in appended if isinstance(e, OutcomeDecided)
        )

    def _compare(self, recorded: OutcomeDecided) -> None:
        seq, derived = self.pending.popleft() if self.pending else (self.session.head_seq, None)
        same = derived is not None and (derived.action, derived.rule) == (
            recorded.data.action, recorded.data.rule
        )
        if same:
            return
        if self.diverged_at is None:
            self.diverged_at = Divergence(seq=seq, recorded=recorded.data, derived=derived)
        else:
            self.unapplied.append(recorded)

    def view(self) -> SessionView:
        """The view of everything fed so far."""
        return view_of(self.session, unapplied=self.unapplied, diverged_at=self.diverged_at)


def recorded_policy(events: Iterable[Event]) -> str:
    """The policy a log without `settings.policy` was decided under: its first recorded
    decision's, else v1 (the only policy before seeds named theirs)."""
    return next((e.data.policy for e in events if isinstance(e, OutcomeDecided)), "v1")


def rederive(events: Iterable[Mapping[str, Any] | Event], policy: str | Policy | None = None
             ) -> Replayer:
    """Fold a recorded log, re-deriving its decisions (no view is built); `policy` None
    means the seed's policy (SPEC §3 "Which policy")."""
    given = list(events)
    sealed, _ = seal_seed(given)  # raw grant header values never reach the view
    parsed = parse_events(sealed)
    replayer = Replayer(_session_id(parsed, given[0] if given else None), policy,
                        default=recorded_policy(parsed))
    for index, event in enumerate(parsed):
        try:
            replayer.feed(event)  # the machine renumbers it from 1
        except IllegalTransition as error:
            error.index = index
            raise
    return replayer


def replay(events: Iterable[Mapping[str, Any] | Event], policy: str | Policy | None = None
           ) -> SessionView:
    """Re-derive a session from its JSONL events (recorded decisions are compared, not trusted).

    Raises `BadEvent` for an event that does not parse (with its index) and, before any
    divergence, `IllegalTransition` for one the machine does not accept.
    """
    return rederive(events, policy).view()


def ending(view: SessionView) -> Ending:
    """What `core.why` judges a session by, from its fold."""
    d = view.decision
    failures = [Failure(e.seq, e.data.reason, e.data.detail)
                for e in view.events if e.type == "verification.failed"]
    closed = [e.data.reason for e in view.events if e.type == "session.closed"]
    recorded = [e.data for e in view.events if e.type == "verification.recorded"]
    said = (last_line(recorded[-1].stdout_tail) or last_line(recorded[-1].stderr_tail)
            if recorded else None)
    return Ending(outcome=view.outcome, state=view.state,
                  action=None if d is None else d.action, rule=None if d is None else d.rule,
                  status=None if d is None else d.status,
                  cause_kind=d.cause.kind if d and d.cause else None,
                  cause_message=d.cause.message if d and d.cause else None,
                  error=None if d is None else d.error,
                  reward_valid=d is not None and d.reward_valid, rewards=view.rewards,
                  failures=failures, closed=closed[-1] if closed else None,
                  verifier_said=said)


def why_unscored(view: SessionView) -> list[str]:
    """Why a session did not score, from its events (docs/SPEC.md §13): each
    `verification.failed`'s reason and detail, then, for a session that is not scored (no
    `verify` decision with a valid reward and a recorded verification), an `unscored:` line
    naming what ended it; nothing for a scored session without a failed verification."""
    return unscored_lines(ending(view))


def explain(view: SessionView) -> list[str]:
    """Each decision of a session in words: its policy and rule, the event it fired on,
    the action, and the status, cause and error it rests on."""
    said = []
    for event in view.events:
        if event.type != "outcome.decided":
            continue
        d = event.data
        trigger = view.events[(event.seq or 2) - 2]  # the event just before the decision
        cause = f", cause {d.cause.kind}" if d.cause else ""
        said.append(f"decision at seq {event.seq}: policy {d.policy} rule {d.rule} fired on "
                    f"seq {trigger.seq} ({trigger.type}) → {d.action} (status {d.status}"
                    f"{cause}{', error: ' + d.error if d.error else ''})")
    return said
