"""Alembic environment: runs on the connection the store hands in (`config.attributes`).

The store calls alembic through `store.migrate`, inside `AsyncConnection.run_sync`, so
the same revisions build SQLite (batch mode, since SQLite cannot ALTER most things) and
PostgreSQL. Used without a connection (the plain `alembic` command), it opens the URL in
`sqlalchemy.url` with a synchronous driver.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        render_as_batch=connection.dialect.name == "sqlite",
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    with create_engine(config.get_main_option("sqlalchemy.url") or "").connect() as conn:
        _run(conn)
