"""Persistence: the `Ledger` event store over SQLite (embedded default) or PostgreSQL."""

from store.ledger import AuditReport, Ledger, Seeded
from store.migrate import SchemaOutOfDate
from store.writer import StoredEvent

__all__ = ["AuditReport", "Ledger", "SchemaOutOfDate", "Seeded", "StoredEvent"]
