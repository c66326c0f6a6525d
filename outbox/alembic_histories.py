"""What the outbox's and the inbox's Alembic histories share: the body of their ``env.py``, an
Alembic config for one of them, the revision a database records, an upgrade that says what
it did.

Each history keeps its own version table (``<table>_alembic_version`` beside its tables), so
it never collides with the history of the service that owns the database, and compares only
its own tables in autogenerate.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa
from alembic import command, context
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.pool import NullPool

#: The Alembic config attribute holding the database URL (set by ``outbox db`` and
#: ``outbox inbox install``).
URL_ATTRIBUTE = "database_url"


class VersionedTables(Protocol):
    """Tables with an Alembic history of their own (an outbox table, the inbox tables)."""

    @property
    def schema(self) -> str: ...

    @property
    def qualified_name(self) -> str: ...

    @property
    def version_table(self) -> str: ...


def run_environment(
    url: str, tables: VersionedTables, names: Collection[str], metadata: sa.MetaData
) -> None:
    """The whole of a history's ``env.py``: migrate ``tables`` (offline: print the SQL),
    recording the revision in their own version table; autogenerate compares only the
    tables called ``names`` in their schema, never the service's beside them."""
    schema = tables.schema

    def include_object(obj: Any, name: str | None, type_: str, *_: Any) -> bool:
        if type_ == "table":
            return name in names and (obj.schema or "public") == schema
        return True

    options: dict[str, Any] = {
        "target_metadata": metadata,
        "version_table": tables.version_table,
        "version_table_schema": schema,
        "include_schemas": True,
        "include_object": include_object,
    }
    create_schema = f'CREATE SCHEMA IF NOT EXISTS "{schema}"'
    if context.is_offline_mode():
        context.configure(url=url, literal_binds=True, **options)
        with context.begin_transaction():
            context.execute(create_schema)
            context.run_migrations()
        return

    def migrate(connection: sa.Connection) -> None:
        # The version table lives in the tables' schema, which must exist before Alembic looks.
        connection.execute(sa.text(create_schema))
        connection.commit()
        context.configure(connection=connection, **options)
        with context.begin_transaction():
            context.run_migrations()

    given = context.config.attributes.get("connection")
    if given is not None:
        migrate(given)
        return
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            migrate(connection)
    finally:
        engine.dispose()


def history_config(
    script_location: Path, database_url: str, spec_attribute: str, spec: object
) -> Config:
    """An Alembic Config for the history in ``script_location`` on ``database_url``."""
    # Alembic's default stdout is the one at import time; take the current one (a CLI runner's).
    config = Config(stdout=sys.stdout)
    config.set_main_option("script_location", str(script_location))
    config.attributes[URL_ATTRIBUTE] = database_url
    config.attributes[spec_attribute] = spec
    return config


def revision_of(database_url: str, tables: VersionedTables) -> str | None:
    """The revision the database records for ``tables`` in their own history (None: none)."""
    engine = sa.create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            migration = MigrationContext.configure(
                conn,
                opts={
                    "version_table": tables.version_table,
                    "version_table_schema": tables.schema,
                },
            )
            return migration.get_current_revision()
    finally:
        engine.dispose()


def upgrade_and_report(
    config: Config, database_url: str, tables: VersionedTables, revision: str, what: str
) -> None:
    """Upgrade to ``revision`` and print where ``what`` (the tables' name) was and is now."""
    before = revision_of(database_url, tables)
    command.upgrade(config, revision)
    after = revision_of(database_url, tables)
    if before == after:
        config.print_stdout(f"{what} is already at {after}: nothing to do")
    else:
        config.print_stdout(f"{what} upgraded from {before or 'nothing'} to {after}")
