"""One exception type per way an input can be refused; each leaves nothing behind."""

from __future__ import annotations

from collections.abc import Iterable


class TrialLedgerError(Exception):
    """Base of every error trialledger raises on purpose."""


class BadEvent(TrialLedgerError, ValueError):
    """An event (or JSONL line) that cannot be parsed; names its position and field."""

    def __init__(self, reason: str, *, index: int | None = None, line: int | None = None) -> None:
        self.reason = reason
        self.index = index
        self.line = line
        where = f"line {line}: " if line is not None else (
            f"event {index + 1}: " if index is not None else ""
        )
        super().__init__(f"{where}{reason}")

    def at(self, *, index: int | None = None, line: int | None = None) -> BadEvent:
        """The same error, located at an input position."""
        return BadEvent(self.reason, index=index, line=line)


class IllegalTransition(TrialLedgerError):
    """An event the session's current state does not accept; nothing was appended."""

    def __init__(
        self, state: str | None, event_type: str, allowed: Iterable[str], why: str = ""
    ) -> None:
        self.state = state
        self.event_type = event_type
        self.index: int | None = None  # position in a replayed input, when there is one
        self.allowed = tuple(sorted(allowed))
        shown = state if state is not None else "(no session)"
        extra = f" ({why})" if why else ""
        super().__init__(
            f"{event_type!r} is not allowed in state {shown!r}{extra}; "
            f"allowed: {', '.join(self.allowed) or 'nothing'}"
        )


class SeedRejected(TrialLedgerError, ValueError):
    """A session seed that cannot run as given; the message says what to change."""


class UnknownPolicy(TrialLedgerError, KeyError):
    """A decision-policy version that is not registered."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name, self.known = name, sorted(known)
        super().__init__(f"unknown policy {name!r}; known: {', '.join(self.known)}")

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[type[UnknownPolicy], tuple[str, list[str]]]:
        """Pickled by its arguments: raised in a re-derivation worker, it reaches the
        parent whole (its default pickling lost `known`, and the pool broke instead)."""
        return type(self), (self.name, self.known)


class ConcurrencyConflict(TrialLedgerError):
    """An append whose expected sequence number is stale: another writer got there first."""

    def __init__(self, session_id: str, expected: int, actual: int) -> None:
        self.session_id = session_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"session {session_id}: expected head seq {expected}, but it is {actual}; "
            "re-read the session and retry"
        )


class EventIdConflict(TrialLedgerError):
    """An event id appended again with different content."""

    def __init__(self, event_id: str) -> None:
        self.event_id = event_id
        super().__init__(f"event id {event_id} already exists with different content")


class PolicyNameTaken(TrialLedgerError, ValueError):
    """A policy registered under a built-in name (`v1`, `v2`, `v3`)."""
