"""Create the inbox table and the parked-message table (opt-in branch ``inbox``).

Revision ID: inbox_0001
Revises:
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.inbox.migrate import current_inbox_spec
from outbox.inbox.schema import build_inbox_table, build_parked_table

revision = "inbox_0001"
down_revision = None
branch_labels = ("inbox",)
depends_on = None


def upgrade() -> None:
    spec = current_inbox_spec()
    op.execute(f'CREATE SCHEMA IF NOT EXISTS "{spec.schema}"')
    bind = op.get_bind()
    # The tables exactly as declared (outbox.inbox.schema), so the migrated schema and the
    # declared one cannot drift apart in this first revision.
    metadata = sa.MetaData()
    build_inbox_table(metadata, spec.table, spec.schema).create(bind)
    build_parked_table(metadata, spec.table, spec.schema).create(bind)


def downgrade() -> None:
    spec = current_inbox_spec()
    op.drop_table(spec.parked_name, schema=spec.schema)
    op.drop_table(spec.table, schema=spec.schema)
