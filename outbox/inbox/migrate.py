"""Installing the inbox tables through their own Alembic history (``outbox inbox install``).

The history lives in ``outbox.inbox.migrations`` on a branch labelled ``inbox`` (first revision
``inbox_0001``), apart from the outbox's own chain, so a database gets inbox tables only when
asked. A service that runs Alembic itself adds :data:`VERSIONS_RESOURCE` to its
``version_locations`` instead, and calls :func:`declare_inbox` from its ``env.py``.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import sqlalchemy as sa
from alembic import command, context
from alembic.config import Config

from outbox.alembic_histories import history_config, upgrade_and_report
from outbox.alembic_histories import revision_of as revision_of
from outbox.inbox.schema import (
    DEFAULT_INBOX_SCHEMA,
    DEFAULT_INBOX_TABLE,
    InboxTableSpec,
    build_inbox_table,
    build_parked_table,
)

SPEC_ATTRIBUTE = "inbox_spec"
#: The inbox revisions as an Alembic package resource, for a service's ``version_locations``.
VERSIONS_RESOURCE = "outbox.inbox.migrations:versions"
#: The branch label of the inbox history (``alembic upgrade inbox@head``).
BRANCH = "inbox"


def migrations_dir() -> Path:
    return Path(str(resources.files("outbox.inbox.migrations")))


def current_inbox_spec(config: Config | None = None) -> InboxTableSpec:
    """The inbox tables a migration works on: attributes, ``-x``, environment, defaults."""
    config = config or context.config
    spec = config.attributes.get(SPEC_ATTRIBUTE)
    if isinstance(spec, InboxTableSpec):
        return spec
    x_args = context.get_x_argument(as_dictionary=True)
    schema = (
        x_args.get("inbox_schema") or os.environ.get("OUTBOX_INBOX_SCHEMA") or DEFAULT_INBOX_SCHEMA
    )
    table = x_args.get("inbox_table") or os.environ.get("OUTBOX_INBOX_TABLE") or DEFAULT_INBOX_TABLE
    return InboxTableSpec(schema=schema, table=table)


def declare_inbox(metadata: sa.MetaData) -> tuple[sa.Table, sa.Table]:
    """Declare the inbox tables on a service's ``metadata``, from its Alembic ``env.py``."""
    spec = current_inbox_spec()
    tables = []
    for name, build in ((spec.table, build_inbox_table), (spec.parked_name, build_parked_table)):
        existing = metadata.tables.get(f"{spec.schema}.{name}")
        tables.append(
            existing if existing is not None else build(metadata, spec.table, spec.schema)
        )
    return tables[0], tables[1]


def alembic_config(database_url: str, spec: InboxTableSpec | None = None) -> Config:
    """An Alembic Config for the inbox history on ``database_url``."""
    return history_config(migrations_dir(), database_url, SPEC_ATTRIBUTE, spec or InboxTableSpec())


def install(
    database_url: str,
    spec: InboxTableSpec | None = None,
    revision: str = f"{BRANCH}@head",
    *,
    sql: bool = False,
) -> None:
    """Create the inbox tables or bring them up to date (``sql=True`` prints the SQL)."""
    spec = spec or InboxTableSpec()
    config = alembic_config(database_url, spec)
    if sql:
        command.upgrade(config, revision, sql=True)
        return
    upgrade_and_report(config, database_url, spec, revision, f"inbox {spec.qualified_name}")


def uninstall(database_url: str, spec: InboxTableSpec | None = None) -> None:
    """Drop the inbox tables (every record of applied and parked messages goes with them)."""
    command.downgrade(alembic_config(database_url, spec), "base")
