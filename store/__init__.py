"""Persistence: the `Ledger` event store over SQLite (embedded default) or PostgreSQL.

What this package exports is the public contract (SPEC §10; docs/library.md, "The public
names"): the `Ledger`, what its methods return, and the errors it raises. The rest (the
job queue, `sql`'s reader, the writer…) is importable by its module path and may change.
Its names are imported on first use (PEP 562), so a module of the package that needs no
database — `store.defaults` — loads without SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trialledger.store.collector import tune_collector
    from trialledger.store.errors import (
        AmbiguousSession,
        ConcurrencyConflict,
        EventIdConflict,
        IntegrityViolation,
        LeaseLost,
        NoDatabase,
        NoSession,
        RunnerAlive,
        SchemaOutOfDate,
        StatementRefused,
        StoreError,
        StoreUnavailable,
        UnsupportedDatabase,
    )
    from trialledger.store.ledger import AuditReport, Ledger, Seeded
    from trialledger.store.migrate import upgrade_database
    from trialledger.store.rederive import Difference
    from trialledger.store.writer import StoredEvent

__all__ = ["AmbiguousSession", "AuditReport", "ConcurrencyConflict", "Difference",
           "EventIdConflict", "IntegrityViolation", "LeaseLost", "Ledger", "NoDatabase",
           "NoSession", "RunnerAlive", "SchemaOutOfDate", "Seeded", "StatementRefused",
           "StoreError", "StoreUnavailable", "StoredEvent", "UnsupportedDatabase",
           "tune_collector", "upgrade_database"]
# Where each name lives (the others are the ledger's): every error a `Ledger` raises is
# store.errors' (the two conflicts are core's, and store.errors names them too).
_ERRORS = ("AmbiguousSession", "ConcurrencyConflict", "EventIdConflict", "IntegrityViolation",
           "LeaseLost", "NoDatabase", "NoSession", "RunnerAlive", "SchemaOutOfDate",
           "StatementRefused", "StoreError", "StoreUnavailable", "UnsupportedDatabase")
_WHERE = {"upgrade_database": "migrate", "StoredEvent": "writer", "Difference": "rederive",
          "tune_collector": "collector", **dict.fromkeys(_ERRORS, "errors")}

def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE.get(name, 'ledger')}"), name)
