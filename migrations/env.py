"""Alembic environment for the outbox table's own migration history.

Its version table is ``<table>_alembic_version`` in the outbox schema, so it never collides
with the history of the service that owns the database.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context
from sqlalchemy.pool import NullPool

from outbox.migration_support import current_spec, current_url

config = context.config
spec = current_spec(config)
target_metadata = spec.metadata
spec.table_obj  # noqa: B018 - declares the table on the metadata for autogenerate


def include_object(obj, name, type_, reflected, compare_to):  # type: ignore[no-untyped-def]
    """Compare only the outbox's own table, never the service's tables beside it."""
    if type_ == "table":
        return name == spec.table and (obj.schema or "public") == spec.schema
    return True


def configure_options() -> dict[str, object]:
    return {
        "target_metadata": target_metadata,
        "version_table": spec.version_table,
        "version_table_schema": spec.schema,
        "include_schemas": True,
        "include_object": include_object,
    }


def run_migrations_offline() -> None:
    context.configure(url=current_url(config), literal_binds=True, **configure_options())
    with context.begin_transaction():
        context.execute(f'CREATE SCHEMA IF NOT EXISTS "{spec.schema}"')
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    engine = sa.create_engine(current_url(config), poolclass=NullPool)
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


def _run(connection: sa.Connection) -> None:
    # The version table lives in the outbox schema, which must exist before Alembic looks.
    connection.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{spec.schema}"'))
    connection.commit()
    context.configure(connection=connection, **configure_options())
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
