"""Persistence: the `Ledger` event store over SQLite (embedded default) or PostgreSQL.

Its names are imported on first use (PEP 562), so a module of the package that needs no
database — `store.defaults` — loads without SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trialledger.store.collector import tune_collector
    from trialledger.store.ledger import (
        AmbiguousSession,
        AuditReport,
        Ledger,
        NoDatabase,
        NoSession,
        Seeded,
        StoreUnavailable,
    )
    from trialledger.store.migrate import SchemaOutOfDate, upgrade_database
    from trialledger.store.rederive import Difference
    from trialledger.store.writer import LeaseLost, StoredEvent

__all__ = ["AmbiguousSession", "AuditReport", "Difference", "LeaseLost", "Ledger", "NoDatabase",
           "NoSession", "SchemaOutOfDate", "Seeded", "StoreUnavailable", "StoredEvent",
           "tune_collector", "upgrade_database"]
# Where each name lives (the others are the ledger's).
_WHERE = {"SchemaOutOfDate": "migrate", "upgrade_database": "migrate", "LeaseLost": "writer",
          "StoredEvent": "writer", "Difference": "rederive", "tune_collector": "collector"}

def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE.get(name, 'ledger')}"), name)
