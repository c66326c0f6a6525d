"""Create the outbox table, its indexes and the commit-time NOTIFY rule.

Revision ID: 0001_create_outbox
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

from outbox.migration_support import current_spec

revision = "0001_create_outbox"
down_revision = None
branch_labels = ("outbox",)
depends_on = None


def upgrade() -> None:
    spec = current_spec()
    name, schema = spec.table, spec.schema
    tz = sa.DateTime(timezone=True)
    op.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    op.create_table(
        name,
        sa.Column("id", sa.Uuid(as_uuid=True), primary_key=True),
        sa.Column("seq", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("shard", sa.SmallInteger, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("key", sa.LargeBinary),
        sa.Column("value", sa.LargeBinary),
        sa.Column("content_type", sa.Text),
        # User headers only, as two parallel arrays; NULL (the cheap case) when there are none.
        sa.Column("header_names", pg.ARRAY(sa.Text)),
        sa.Column("header_values", pg.ARRAY(sa.LargeBinary)),
        sa.Column("idempotency_key", sa.Text),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_attempt_at", tz),
        sa.Column("lease_owner", sa.Text),
        sa.Column("lease_until", tz),
        sa.Column("error_kind", sa.Text),
        sa.Column("last_error", sa.Text),
        sa.Column("created_at", tz, nullable=False, server_default=sa.func.now()),
        sa.Column("sent_at", tz),
        sa.Column("kafka_partition", sa.Integer),
        sa.Column("kafka_offset", sa.BigInteger),
        sa.CheckConstraint("status IN ('pending', 'sent', 'dead')", name=f"{name}_status_check"),
        schema=schema,
    )
    op.create_index(
        f"{name}_pending_idx",
        name,
        ["shard", "seq"],
        schema=schema,
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        f"{name}_idempotency_key_idx",
        name,
        ["idempotency_key"],
        unique=True,
        schema=schema,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    # The commit-time wake-up: every INSERT also queues a NOTIFY, which Postgres delivers only
    # when the transaction commits (and folds repeats within it), so relays hear of committed
    # rows only. A rule costs far less per statement than a trigger; COPY bypasses it, and the
    # relay's polling covers that.
    op.execute(
        f'CREATE RULE "{spec.notify_rule}" AS ON INSERT TO "{schema}"."{name}" '
        f'DO ALSO NOTIFY "{spec.notify_channel}"'
    )


def downgrade() -> None:
    spec = current_spec()
    op.execute(f'DROP RULE IF EXISTS "{spec.notify_rule}" ON "{spec.schema}"."{spec.table}"')
    op.drop_table(spec.table, schema=spec.schema)
