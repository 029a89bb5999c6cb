"""Persistence: the `Ledger` event store over SQLite (embedded default) or PostgreSQL."""

from trialledger.store.ledger import AuditReport, Ledger, NoDatabase, NoSession, Seeded
from trialledger.store.migrate import SchemaOutOfDate
from trialledger.store.writer import StoredEvent

__all__ = ["AuditReport", "Ledger", "NoDatabase", "NoSession", "SchemaOutOfDate", "Seeded",
           "StoredEvent"]
