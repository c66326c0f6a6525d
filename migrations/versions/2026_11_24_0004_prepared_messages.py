"""Prepared messages with check-back: two more statuses, the check columns, their index.

A prepared message is a row with status ``prepared``: the relay reads only pending rows, so it
never sees it. Its producer commits it (it becomes ``pending``) or rolls it back
(``rolled_back``, final); when that word is lost, a check-back runner asks the service's
checker. The new columns record when the message was prepared, the name its checker is
registered under, when it is checked next, every check, and how it ended.
``<table>_prepared_idx`` holds the prepared rows only (few), in the order the runners take them.

The status constraint is replaced ``NOT VALID`` and then validated: validation reads the table
under a lock that lets writers and the relay go on. The new columns have no default or a
constant one, so adding them rewrites nothing.

Downgrading refuses while prepared messages exist (commit or roll them back first) and
deletes rolled-back rows, which the older statuses cannot hold (they were never published).

Revision ID: 0004_prepared_messages
Revises: 0003_wake_trigger
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migration_support import current_spec

revision = "0004_prepared_messages"
down_revision = "0003_wake_trigger"
branch_labels = None
depends_on = None

_NEW_STATUSES = "('pending', 'sent', 'dead', 'prepared', 'rolled_back')"
_OLD_STATUSES = "('pending', 'sent', 'dead')"


def upgrade() -> None:
    spec = current_spec()
    tz = sa.DateTime(timezone=True)
    columns = [
        sa.Column("prepared_at", tz),
        sa.Column("check_group", sa.Text),
        sa.Column("next_check_at", tz),
        sa.Column("check_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_checked_at", tz),
        sa.Column("last_check_answer", sa.Text),
        sa.Column("last_check_error", sa.Text),
        sa.Column("resolved_at", tz),
        sa.Column("resolved_by", sa.Text),
    ]
    for column in columns:
        op.add_column(spec.table, column, schema=spec.schema)
    _replace_status_check(_NEW_STATUSES)
    op.create_index(
        spec.prepared_index,
        spec.table,
        ["next_check_at"],
        schema=spec.schema,
        postgresql_where=sa.text("status = 'prepared'"),
    )


def downgrade() -> None:
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    op.execute(
        f"""
        DO $refuse$
        BEGIN
            IF EXISTS (SELECT 1 FROM {table} WHERE status = 'prepared') THEN
                RAISE EXCEPTION '{spec.qualified_name} holds prepared messages: commit or roll '
                    'them back first (outbox prepared list)';
            END IF;
        END
        $refuse$
        """
    )
    op.execute(f"DELETE FROM {table} WHERE status = 'rolled_back'")
    op.drop_index(spec.prepared_index, table_name=spec.table, schema=spec.schema)
    _replace_status_check(_OLD_STATUSES)
    for name in (
        "resolved_by",
        "resolved_at",
        "last_check_error",
        "last_check_answer",
        "last_checked_at",
        "check_count",
        "next_check_at",
        "check_group",
        "prepared_at",
    ):
        op.drop_column(spec.table, name, schema=spec.schema)


def _replace_status_check(statuses: str) -> None:
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    name = f'"{spec.table}_status_check"'
    op.execute(
        f"ALTER TABLE {table} DROP CONSTRAINT {name}, "
        f"ADD CONSTRAINT {name} CHECK (status IN {statuses}) NOT VALID"
    )
    op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")
