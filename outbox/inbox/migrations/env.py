"""Alembic environment for the inbox tables' own, opt-in history (branch ``inbox``).

Kept apart from the outbox's history so that ``outbox db upgrade`` never creates inbox
tables and the outbox's revisions stay one linear chain. Its version table is
``<inbox table>_alembic_version`` beside the inbox tables.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import context
from sqlalchemy.pool import NullPool

from outbox.inbox.migrate import current_inbox_spec
from outbox.migration_support import current_url

config = context.config
spec = current_inbox_spec(config)
target_metadata = spec.metadata
spec.inbox  # noqa: B018 - declares the tables on the metadata for autogenerate
spec.parked  # noqa: B018


def include_object(obj, name, type_, reflected, compare_to):  # type: ignore[no-untyped-def]
    """Compare only the inbox's own tables, never the service's tables beside them."""
    if type_ == "table":
        return name in (spec.table, spec.parked_name) and (obj.schema or "public") == spec.schema
    return True


def configure_options() -> dict[str, Any]:
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
    engine = sa.create_engine(current_url(config), poolclass=NullPool)
    with engine.connect() as connection:
        connection.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{spec.schema}"'))
        connection.commit()
        context.configure(connection=connection, **configure_options())
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
