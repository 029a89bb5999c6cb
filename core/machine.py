"""The session state machine (SPEC §1): the transition table as data, and the fold.

`Session.apply(event)` checks an event against the table, appends it (numbering it and
giving it its reproducible id) and, when the run's evidence is complete or a probe has
answered, appends the `outcome.decided` the policy derives. It returns every event it
appended; on an illegal event it raises `IllegalTransition` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, NamedTuple

from trialledger.core.canonical import event_id_for
from trialledger.core.errors import IllegalTransition
from trialledger.core.events import (
    CODEX_STREAM_TYPES,
    Decision,
    Event,
    OutcomeDecided,
    SessionSeeded,
)
from trialledger.core.policy import Policy, get_policy

State = Literal["seeded", "starting", "running", "failed-live", "graded", "lost", "closed"]
STATES: tuple[State, ...] = (
    "seeded", "starting", "running", "failed-live", "graded", "lost", "closed"
)
SAME = "same"  # the event leaves the state as it is
BY_ACTION = "by-action"  # `outcome.decided`: the target follows the decision's action

EVIDENCE = (CODEX_STREAM_TYPES - {"turn.started"}) | {
    "usage.native", "agent.stderr", "agent.exited", "cleanup.reported", "gap.recorded",
    "model.call"
}
LATE = EVIDENCE | {"turn.started", "archive.copied", "archive.skipped"}
# A session only leaves running for failed-live or graded once both of these are in the log,
# so there they can never come late (only `lost`, after a lost sandbox, can still take them).
LATE_AFTER_EXIT = LATE - {"agent.exited", "cleanup.reported"}


def _rows(types: Iterable[str], target: str) -> dict[str, str]:
    return dict.fromkeys(types, target)


_LIVE = {"sandbox.lost": SAME, "outcome.decided": BY_ACTION, "session.closed": "closed"}

TRANSITIONS: Mapping[State | None, Mapping[str, str]] = {
    None: {"session.seeded": "seeded"},
    "seeded": {"agent.launched": "starting", "gap.recorded": SAME, **_LIVE},
    "starting": {**_rows(EVIDENCE, SAME), "turn.started": "running", **_LIVE},
    "running": {**_rows(EVIDENCE, SAME), "turn.started": "running", **_LIVE},
    "failed-live": {**_rows(LATE_AFTER_EXIT, SAME), "sandbox.probed": SAME, **_LIVE},
    "graded": {
        **_rows(LATE_AFTER_EXIT, SAME),
        "verification.recorded": SAME,
        "verification.failed": SAME,
        "session.closed": "closed",
    },
    "lost": {**_rows(LATE, SAME), "session.closed": "closed"},
    "closed": {},
}
DECISION_TARGETS: Mapping[State | None, Mapping[str, State]] = {
    "seeded": {"retry": "lost"},
    "starting": {"verify": "graded", "retry": "lost"},
    "running": {"verify": "graded", "retry": "lost", "probe": "failed-live"},
    "failed-live": {"verify": "graded", "retry": "lost"},
}
# Each group may appear at most once in a log (one event of the group, once).
ONCE: tuple[frozenset[str], ...] = (
    frozenset({"agent.exited"}),
    frozenset({"cleanup.reported"}),
    frozenset({"sandbox.probed"}),
    frozenset({"sandbox.lost"}),
    frozenset({"verification.recorded", "verification.failed"}),
)
ONCE_GROUP = {kind: group for group in ONCE for kind in group}
MACHINE_ONLY = frozenset({"outcome.decided"})
TRIGGERS = frozenset({"sandbox.probed", "sandbox.lost", "agent.exited", "cleanup.reported"})


class Mark(NamedTuple):
    """What `Session.rollback` restores."""

    events: int
    decisions: int
    state: State | None
    seen: frozenset[str]
    transition_seq: int


class Session:
    """The folded state of one session: its log, its state and its decisions."""

    __slots__ = ("_fixed", "_seen", "decisions", "events", "policy", "session_id", "state",
                 "transition_seq")

    def __init__(self, session_id: str, policy: str | Policy | None = None, *,
                 default: str | Policy = "v1") -> None:
        """`policy` decides every decision; without it, the seed's `settings.policy` does,
        else `default` (SPEC §3 "Which policy")."""
        self.session_id = session_id
        self._fixed = policy is not None
        self.policy = get_policy(policy if policy is not None else default)
        self.state: State | None = None
        self.events: list[Event] = []
        self.decisions: list[Decision] = []
        self._seen: set[str] = set()
        self.transition_seq = 0  # the seq of the last event that changed the state

    @property
    def head_seq(self) -> int:
        """The seq of the last event (0 for an empty log)."""
        return len(self.events)

    @property
    def seed(self) -> SessionSeeded | None:
        """The session's seed event, once there is one."""
        first = self.events[0] if self.events else None
        return first if isinstance(first, SessionSeeded) else None

    def has(self, kind: str) -> bool:
        """Whether an event of this type is in the log."""
        return kind in self._seen

    def allowed(self) -> list[str]:
        """The event types the current state accepts now (machine-only ones excluded)."""
        return sorted(
            kind for kind in TRANSITIONS[self.state]
            if kind not in MACHINE_ONLY and not self._exhausted(kind)
        )

    def _exhausted(self, kind: str) -> bool:
        group = ONCE_GROUP.get(kind)
        return group is not None and not self._seen.isdisjoint(group)

    def check(self, event: Event) -> None:
        """Raise `IllegalTransition` unless the current state accepts this event from a harness."""
        kind = event.type
        if kind in MACHINE_ONLY:
            raise IllegalTransition(
                self.state, kind, self.allowed(), "it is written by the machine, never a harness"
            )
        self._check(kind)

    def _check(self, kind: str) -> None:
        if kind not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.state, kind, self.allowed())
        if self._exhausted(kind):
            raise IllegalTransition(self.state, kind, self.allowed(), "it may appear only once")

    def mark(self) -> Mark:
        """A point to roll back to (for all-or-nothing batches of appends)."""
        return Mark(len(self.events), len(self.decisions), self.state, frozenset(self._seen),
                    self.transition_seq)

    def rollback(self, mark: Mark) -> None:
        """Undo every append made since `mark`."""
        del self.events[mark.events:]
        del self.decisions[mark.decisions:]
        self.state, self._seen = mark.state, set(mark.seen)
        self.transition_seq = mark.transition_seq

    def apply(self, event: Event) -> list[Event]:
        """Append a harness event; return it (numbered) and any decision it triggered."""
        self.check(event)
        if event.type not in TRIGGERS:  # the common case: nothing to decide, nothing to undo
            return [self._append(event, checked=True)]
        mark = self.mark()
        appended = [self._append(event, checked=True)]
        try:
            decision = self._triggered_decision(event.type)
            if decision is not None:
                appended.append(self._append(OutcomeDecided(at=event.at, data=decision)))
        except BaseException:
            self.rollback(mark)  # a decision that cannot apply takes its trigger back out
            raise
        return appended

    def load(self, event: Event) -> None:
        """Fold one event of this session's own stored log, as recorded (decisions included).

        The store reloads a session this way: its decisions were derived when appended,
        so they are trusted here and a policy change never rewrites an open session's past.
        """
        if event.seq != len(self.events) + 1:
            why = f"stored seq {event.seq} is out of order"
            raise IllegalTransition(self.state, event.type, (), why)
        self._append(event)

    def _triggered_decision(self, kind: str) -> Decision | None:
        if kind == "sandbox.probed":
            return self.policy.decide(self.events, after_probe=True)
        if kind == "sandbox.lost" or (
            kind in ("agent.exited", "cleanup.reported")
            and not self.decisions  # late evidence never re-decides
            and {"agent.exited", "cleanup.reported"} <= self._seen
        ):
            return self.policy.decide(self.events)
        return None

    def _append(self, event: Event, *, checked: bool = False) -> Event:
        if not checked:
            self._check(event.type)
        target = TRANSITIONS[self.state][event.type]
        if isinstance(event, OutcomeDecided):
            target = DECISION_TARGETS.get(self.state, {}).get(event.data.action, "")
            if not target:
                raise IllegalTransition(
                    self.state, event.type, (), f"action {event.data.action!r} cannot apply here"
                )
        seq = len(self.events) + 1
        event_id = event.event_id or event_id_for(self.session_id, seq)
        # An event that already holds its place (a stored one, reloaded or re-derived) is
        # kept as it is: it is immutable, and a copy is three more objects to collect.
        numbered = event if (event.seq, event.session_id, event.event_id) == (
            seq, self.session_id, event_id) else _numbered(event, self.session_id, seq, event_id)
        if isinstance(numbered, OutcomeDecided):
            self.decisions.append(numbered.data)
        elif isinstance(numbered, SessionSeeded) and not self._fixed:
            named = numbered.data.settings.policy
            if named is not None:
                self.policy = get_policy(named)
        if target != SAME and target != self.state:
            self.state = _state(target)
            self.transition_seq = seq
        self.events.append(numbered)
        self._seen.add(event.type)
        return numbered


_NUMBERING = frozenset({"session_id", "seq", "event_id"})


def _numbered(event: Event, session_id: str, seq: int, event_id: str) -> Event:
    """A copy of a (validated, immutable) event with its place in the log filled in.

    What `model_copy(update=...)` does, without its generic machinery: it runs for every
    appended event and was a third of an append's cost.
    """
    cls = type(event)
    numbered = cls.__new__(cls)
    fields = {**event.__dict__, "session_id": session_id, "seq": seq, "event_id": event_id}
    object.__setattr__(numbered, "__dict__", fields)
    object.__setattr__(numbered, "__pydantic_fields_set__",
                       event.__pydantic_fields_set__ | _NUMBERING)
    object.__setattr__(numbered, "__pydantic_extra__", event.__pydantic_extra__)
    object.__setattr__(numbered, "__pydantic_private__", event.__pydantic_private__)
    return numbered


def _state(name: str) -> State:
    assert name in STATES, name
    return name
