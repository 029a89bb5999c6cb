"""Dropping a column, as the revisions' downgrades do.

SQLite checks its whole schema again after `ALTER TABLE … DROP COLUMN`: it prepares every
view, and the job views are large (preparing `job_tasks` alone takes 0.3–0.5 s), so three
dropped columns took 2 s. Here the views are set aside first — each dropped, the column
dropped, each created again from its own text, in the order the database made them — so the
check has nothing to prepare. PostgreSQL checks only what depends on the column, which
nothing does when a downgrade drops it, so there it is the plain statement.
"""

from __future__ import annotations

from collections.abc import Iterable

from alembic import op
from sqlalchemy import text


def drop_columns(table: str, names: Iterable[str]) -> None:
    """`ALTER TABLE table DROP COLUMN name` for each name, in order."""
    statements = [f"ALTER TABLE {table} DROP COLUMN {name}" for name in names]
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        for statement in statements:
            op.execute(statement)
        return
    views = [(name, sql) for name, sql in bind.execute(text(
        "SELECT name, sql FROM sqlite_master WHERE type = 'view' ORDER BY rowid"))]
    for name, _ in reversed(views):
        op.execute(f"DROP VIEW {name}")
    for statement in statements:
        op.execute(statement)
    for _, sql in views:
        op.execute(sql)
