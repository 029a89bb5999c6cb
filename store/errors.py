"""Every error the store raises, by kind, and the guard at its boundary.

A driver's error leaves the store as one of three kinds, as PEP 249 keeps its classes
apart (and eventsourcing keeps them apart in its recorders):

- `StoreUnavailable`: the database could not be used — connection lost or refused, locked
  past its wait, disk full, damaged, shut down. It may pass: callers that ride out a store's
  blink (the runner's appends, a job's claims) retry it for their `store_retry_s`.
- `IntegrityViolation`: a constraint refused a write (PEP 249 `IntegrityError`; PostgreSQL
  SQLSTATE class 23). Retrying gives the same answer: raised at once, one line naming it.
- `StatementRefused`: a statement the database cannot run as written (`ProgrammingError`,
  `DataError`, `NotSupportedError`; SQLSTATE classes 22, 42, 0A, …): a bug, raised at once.

>>> class Store:                                                    # doctest: +SKIP
...     db = "trials.db"
...     @guarded
...     async def count(self) -> int: ...

`guarded` is put on each public method of `Ledger` and `Jobs`, where a reader sees it.
The store's other refusals (`NoSession`, `LeaseLost`, `JobRefused`, …) live here too, and
stay importable from the modules that raised them before.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from sqlalchemy import exc

from trialledger.core.errors import ConcurrencyConflict, EventIdConflict, TrialLedgerError
from trialledger.store.urls import UnsupportedDatabase as UnsupportedDatabase
from trialledger.store.urls import shown, sqlite_path

# PostgreSQL SQLSTATE classes of a statement that is wrong as written (retrying cannot help):
# data exception, cardinality, syntax or access rule, feature not supported, invalid SQL
# statement name, invalid transaction termination, with check option.
_WRONG_AS_WRITTEN = ("22", "21", "42", "0A", "26", "2D", "44")
_INTEGRITY = "23"


class StoreError(TrialLedgerError):
    """A database error, of one of the kinds below (the driver's message, one line)."""


class StoreUnavailable(StoreError):
    """The database could not be used (unreachable, locked past its wait, full, damaged):
    the driver's error, in one line, with any password masked. Worth retrying."""

    @classmethod
    def of(cls, db: str, error: BaseException) -> StoreUnavailable:
        """The error for `db` (`disk full` however the driver words it)."""
        text = str(error).strip()
        reason = disk_full(db, error) or shown(db, text.splitlines()[0] if text
                                               else type(error).__name__)
        return cls(f"cannot use the database {shown(db)}: {reason}")


class IntegrityViolation(StoreError):
    """A write a constraint of the database refused (PEP 249 `IntegrityError`): never
    retried; the message names the constraint."""

    @classmethod
    def of(cls, db: str, error: BaseException) -> IntegrityViolation:
        """The error for `db`, naming the constraint (and the key, when the driver says)."""
        return cls(f"the database {shown(db)} refused a write: "
                   f"{shown(db, _first_line(error))}{_detail(error)}")


class StatementRefused(StoreError):
    """A statement the database cannot run as written (PEP 249 `ProgrammingError`,
    `DataError`, `NotSupportedError`): a bug in the caller, never retried."""

    @classmethod
    def of(cls, db: str, error: BaseException) -> StatementRefused:
        """The error for `db`, in the driver's words."""
        return cls(f"the database {shown(db)} refused a statement: "
                   f"{shown(db, _first_line(error))}")


def _driver_error(error: BaseException) -> BaseException:
    """The driver's own error behind SQLAlchemy's wrapper."""
    return error.orig if isinstance(error, exc.DBAPIError) and error.orig is not None \
        else error


def _first_line(error: BaseException) -> str:
    text = str(_driver_error(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _detail(error: BaseException) -> str:
    """PostgreSQL's DETAIL (`Key (name)=(x) already exists.`), in parentheses."""
    detail = getattr(_driver_error(error), "detail", None)
    return f" ({str(detail).splitlines()[0]})" if detail else ""


def _sqlstate(error: BaseException) -> str | None:
    value = getattr(_driver_error(error), "sqlstate", None)
    return str(value) if value else None


def store_error(db: str, error: BaseException) -> StoreError:
    """The store's kind of a driver's (or the operating system's) error."""
    if isinstance(error, exc.DBAPIError) and not error.connection_invalidated:
        state = _sqlstate(error)
        if isinstance(error, exc.IntegrityError) or (state or "").startswith(_INTEGRITY):
            return IntegrityViolation.of(db, error)
        if isinstance(error, exc.ProgrammingError | exc.DataError | exc.NotSupportedError) \
                or (state is not None and state[:2] in _WRONG_AS_WRITTEN):
            return StatementRefused.of(db, error)
    elif isinstance(error, exc.SQLAlchemyError) and not isinstance(
            error, exc.DBAPIError | exc.DisconnectionError | exc.TimeoutError) and not (
            isinstance(error, exc.StatementError) and isinstance(error.orig, OSError)):
        return StatementRefused.of(db, error)  # SQLAlchemy's own refusal: our statement
    return StoreUnavailable.of(db, error)


def disk_full(db: str, error: BaseException) -> str | None:
    """"disk full", whatever words the driver found for it (SQLite says "disk I/O error"
    when only a few KiB are left)."""
    text = str(error)
    if getattr(error, "errno", None) == errno.ENOSPC or "disk is full" in text:
        return "disk full"
    path = sqlite_path(db) if "://" not in db or db.startswith("sqlite") else None
    if path is not None and "disk I/O error" in text:
        with contextlib.suppress(OSError):
            if shutil.disk_usage(os.path.dirname(path) or ".").free < 1024 * 1024:
                return "disk full"
    return None


P = ParamSpec("P")
R = TypeVar("R")


class _OfStore(Protocol):
    db: str


S = TypeVar("S", bound=_OfStore)


def guarded(method: Callable[Concatenate[S, P], Coroutine[Any, Any, R]]
            ) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """The store's boundary on a public method: a driver's error leaves it as its kind
    (`store_error`); the store's own errors pass as they are."""

    @functools.wraps(method)
    async def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(self, *args, **kwargs)
        except TrialLedgerError:
            raise
        except (exc.SQLAlchemyError, OSError) as error:
            raise store_error(self.db, error) from error

    return call


class AmbiguousSession(TrialLedgerError):
    """A session id prefix that more than one session starts with."""

    def __init__(self, prefix: str, candidates: Sequence[str]) -> None:
        listed = ", ".join(candidates[:5]) + (", …" if len(candidates) > 5 else "")
        super().__init__(f"{prefix!r} starts more than one session id: {listed}")


class RunnerAlive(TrialLedgerError):
    """`recover` of a runner whose heartbeat is fresh (it is still running)."""


class NoDatabase(TrialLedgerError):
    """A read-only use of a store that does not exist (nothing was created)."""


class NoSession(TrialLedgerError, KeyError):
    """A session id the store does not hold (a `KeyError` too, for older callers)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session {session_id}")
        self.session_id = session_id

    def __str__(self) -> str:
        return str(self.args[0])


class LeaseLost(TrialLedgerError):
    """An append fenced by a job trial's lease that is no longer the caller's (the trial
    was taken over): nothing appended."""


class SchemaOutOfDate(TrialLedgerError):
    """A database built by older (or newer) code; never migrated silently."""


class JobRefused(TrialLedgerError):
    """A job that cannot be created or resumed as asked (the message says why)."""


class NoJob(JobRefused):
    """No job of that name in the store."""


class QueryRefused(TrialLedgerError):
    """A query that failed, wrote, or ran past its time limit."""


__all__ = ["AmbiguousSession", "ConcurrencyConflict", "EventIdConflict", "IntegrityViolation",
           "JobRefused", "LeaseLost", "NoDatabase", "NoJob", "NoSession", "QueryRefused",
           "RunnerAlive", "SchemaOutOfDate", "StatementRefused", "StoreError",
           "StoreUnavailable", "UnsupportedDatabase", "disk_full", "guarded", "store_error"]
