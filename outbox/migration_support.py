"""Where the outbox migrations find their database and table names.

The Alembic environment and every revision ask :func:`current_spec`, which looks, in order,
at the Alembic config's attributes (set by ``outbox db ...``), ``-x outbox_schema=...`` /
``-x outbox_table=...`` on the alembic command line, ``OUTBOX_SCHEMA`` / ``OUTBOX_TABLE``, and
then the defaults (``public.outbox``). A service that includes these revisions in its own
Alembic history gets the same behaviour: its ``alembic.ini`` lists
:data:`VERSIONS_RESOURCE` in ``version_locations`` (Alembic reads that list before any
``env.py`` runs, so it cannot be set from there), and its ``env.py`` calls
:func:`declare_outbox` so that autogenerate compares the outbox table instead of proposing
to drop it. docs/migrations.md has the whole recipe.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import sqlalchemy as sa
from alembic import context, op
from alembic.config import Config

from outbox.alembic_histories import URL_ATTRIBUTE, history_config
from outbox.engines import database_url as psycopg_url
from outbox.errors import ConfigError
from outbox.schema import DEFAULT_SCHEMA, DEFAULT_TABLE, OutboxTableSpec, build_table

SPEC_ATTRIBUTE = "outbox_spec"
#: The partition interval (``daily`` or ``hourly``) when the table is to have the partitioned
#: layout (docs/retention.md), set by ``outbox db upgrade --partitioned``.
PARTITIONED_ATTRIBUTE = "outbox_partitioned"

#: The outbox revisions as an Alembic package resource, for a service's ``version_locations``.
VERSIONS_RESOURCE = "outbox.migrations:versions"

#: Longest wait of a revision for the outbox table's exclusive lock; every reader and writer
#: of the table queues behind that wait.
LOCK_TIMEOUT = "5s"


def migrations_dir() -> Path:
    """The folder holding ``env.py`` and ``versions/`` (installed as ``outbox.migrations``)."""
    return Path(str(resources.files("outbox.migrations")))


def current_spec(config: Config | None = None) -> OutboxTableSpec:
    config = config or context.config
    spec = config.attributes.get(SPEC_ATTRIBUTE)
    if isinstance(spec, OutboxTableSpec):
        return spec
    x_args = context.get_x_argument(as_dictionary=True)
    schema = x_args.get("outbox_schema") or os.environ.get("OUTBOX_SCHEMA") or DEFAULT_SCHEMA
    table = x_args.get("outbox_table") or os.environ.get("OUTBOX_TABLE") or DEFAULT_TABLE
    return OutboxTableSpec(schema=schema, table=table)


def current_partitioning(config: Config | None = None) -> str | None:
    """The partition interval the table should be created with, or None for a plain table:
    the Alembic config's attribute, ``-x outbox_partitioned=daily``, or
    ``OUTBOX_PARTITIONED``."""
    config = config or context.config
    interval = (
        config.attributes.get(PARTITIONED_ATTRIBUTE)
        or context.get_x_argument(as_dictionary=True).get("outbox_partitioned")
        or os.environ.get("OUTBOX_PARTITIONED")
    )
    return str(interval) if interval else None


def current_url(config: Config | None = None) -> str:
    config = config or context.config
    url = (
        config.attributes.get(URL_ATTRIBUTE)
        or context.get_x_argument(as_dictionary=True).get("database_url")
        or os.environ.get("OUTBOX_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise ConfigError("no database URL: set OUTBOX_DATABASE_URL or pass --database-url")
    return psycopg_url(str(url))


def declare_outbox(metadata: sa.MetaData) -> sa.Table:
    """Declare the outbox table on a service's ``metadata``, from its Alembic ``env.py``.

    Autogenerate then compares the table with what the outbox revisions built (and finds
    nothing to do) instead of proposing to drop it. Schema and table follow the same
    settings as the revisions (see :func:`current_spec`). Declaring it twice is harmless.

    >>> target_metadata = Base.metadata
    >>> declare_outbox(target_metadata)
    """
    spec = current_spec()
    key = f"{spec.schema}.{spec.table}" if spec.schema else spec.table
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    return build_table(metadata, spec.table, spec.schema)


def alembic_config(database_url: str, spec: OutboxTableSpec | None = None) -> Config:
    """An Alembic Config for the outbox's own history on ``database_url``."""
    return history_config(migrations_dir(), database_url, SPEC_ATTRIBUTE, spec or OutboxTableSpec())


def lock_outbox_table(spec: OutboxTableSpec) -> None:
    """Take the outbox table's exclusive lock for the rest of the revision's transaction,
    waiting at most :data:`LOCK_TIMEOUT`; then fail with nothing changed.

    Dropping or creating a trigger or rule needs that lock. Asked for without a limit, a
    transaction left open on the table would queue every reader and writer behind the
    migration for as long as it stays open."""
    table = f'"{spec.schema}"."{spec.table}"'
    op.execute(
        f"""
        DO $lock$
        BEGIN
            SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';
            LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE;
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION '{spec.qualified_name} stayed locked by another transaction for '
                '{LOCK_TIMEOUT}: nothing was changed; run the migration again when no long '
                'transaction holds the table (see pg_stat_activity)';
        END
        $lock$
        """
    )
