"""Create the outbox table, its indexes and the commit-time NOTIFY trigger.

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
    # One NOTIFY per inserting statement; Postgres delivers it only when the transaction
    # commits (and folds repeats within a transaction), so relays wake for committed rows only.
    op.execute(
        f"""
        CREATE FUNCTION "{schema}"."{spec.notify_function}"() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{spec.notify_channel}', '');
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        f'CREATE TRIGGER "{spec.notify_function}" AFTER INSERT ON "{schema}"."{name}" '
        f'FOR EACH STATEMENT EXECUTE FUNCTION "{schema}"."{spec.notify_function}"()'
    )


def downgrade() -> None:
    spec = current_spec()
    op.execute(f'DROP TRIGGER IF EXISTS "{spec.notify_function}" ON "{spec.schema}"."{spec.table}"')
    op.execute(f'DROP FUNCTION IF EXISTS "{spec.schema}"."{spec.notify_function}"()')
    op.drop_table(spec.table, schema=spec.schema)
