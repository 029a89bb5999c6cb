"""Persistence: the `Ledger` event store over SQLite (embedded default) or PostgreSQL."""

from trialledger.store.ledger import (
    AmbiguousSession,
    AuditReport,
    Ledger,
    NoDatabase,
    NoSession,
    Seeded,
    StoreUnavailable,
)
from trialledger.store.migrate import SchemaOutOfDate
from trialledger.store.writer import LeaseLost, StoredEvent

__all__ = ["AmbiguousSession", "AuditReport", "LeaseLost", "Ledger", "NoDatabase", "NoSession",
           "SchemaOutOfDate", "Seeded", "StoreUnavailable", "StoredEvent"]
