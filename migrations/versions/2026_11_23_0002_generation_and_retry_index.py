"""Requeue generation and the retry index.

``generation`` goes up each time repair puts a sent row back to pending; an exactly-once
progress record vouches only for the generation it sent. ``<table>_retry_idx`` holds the
pending rows that have failed at least once (few), keyed so that the relay can pass over the
rows of a key that is backing off without reading them one by one from the table.

Revision ID: 0002_generation_retry_idx
Revises: 0001_create_outbox
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migration_support import current_spec

revision = "0002_generation_retry_idx"
down_revision = "0001_create_outbox"
branch_labels = None
depends_on = None


def upgrade() -> None:
    spec = current_spec()
    # A constant default: PostgreSQL adds the column without rewriting the table.
    op.add_column(
        spec.table,
        sa.Column("generation", sa.Integer, nullable=False, server_default="0"),
        schema=spec.schema,
    )
    op.create_index(
        spec.retry_index,
        spec.table,
        ["shard", "topic", "key", "seq"],
        schema=spec.schema,
        postgresql_where=sa.text("status = 'pending' AND next_attempt_at IS NOT NULL"),
    )


def downgrade() -> None:
    spec = current_spec()
    op.drop_index(spec.retry_index, table_name=spec.table, schema=spec.schema)
    op.drop_column(spec.table, "generation", schema=spec.schema)
