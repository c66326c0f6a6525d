"""The order service's Alembic environment: its own tables, plus the outbox's revisions.

Alembic's generic template with two additions: the URL comes from ``OUTBOX_DATABASE_URL``
(the service and its migrations use one database), and ``declare_outbox`` puts the outbox
table on the metadata, so that autogenerate compares it instead of proposing to drop it.
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from alembic import context
from sqlalchemy.pool import NullPool

from examples.fastapi_service.models import Base
from outbox.migration_support import declare_outbox

config = context.config
target_metadata = Base.metadata
declare_outbox(target_metadata)


def database_url() -> str:
    url = os.environ.get("OUTBOX_DATABASE_URL")
    if not url:
        raise SystemExit("set OUTBOX_DATABASE_URL to the service's database")
    return url


def run_migrations_offline() -> None:
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = sa.create_engine(database_url(), poolclass=NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
