"""Persistence: the `Ledger` event store over SQLite (embedded default) or PostgreSQL."""

from store.ledger import AuditReport, Ledger, Seeded, StoredEvent
from store.migrate import SchemaOutOfDate

__all__ = ["AuditReport", "Ledger", "SchemaOutOfDate", "Seeded", "StoredEvent"]
