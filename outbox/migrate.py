"""Running the outbox's Alembic history: what ``outbox db ...`` calls."""

from __future__ import annotations

from alembic import command

from outbox.migration_support import alembic_config
from outbox.schema import OutboxTableSpec


def upgrade(
    database_url: str,
    spec: OutboxTableSpec | None = None,
    revision: str = "head",
    *,
    sql: bool = False,
) -> None:
    """Create or upgrade the outbox table (``sql=True`` prints the SQL instead)."""
    command.upgrade(alembic_config(database_url, spec), revision, sql=sql)


def downgrade(
    database_url: str,
    spec: OutboxTableSpec | None = None,
    revision: str = "base",
    *,
    sql: bool = False,
) -> None:
    """Step the outbox schema back to ``revision`` (``base`` drops the table)."""
    command.downgrade(alembic_config(database_url, spec), revision, sql=sql)


def current(database_url: str, spec: OutboxTableSpec | None = None) -> None:
    """Print the revision the database is at."""
    command.current(alembic_config(database_url, spec))
