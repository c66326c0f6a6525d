"""Scheduled messages: two more statuses, the ``deliver_at`` column and its index.

A scheduled message is a row with status ``scheduled`` and a ``deliver_at``: the relay reads
only pending rows (through the pending index), so it never sees it, however many wait. When
it falls due, the relay that owns its shard makes it pending with a new seq (it joins its
key's order then, as a committed prepared message does). One cancelled before that ends
``cancelled`` (final: never sent). ``<table>_scheduled_idx`` holds the scheduled rows only, by
shard and due time: the relay reads its due end, and the first entry still ahead.

Locks: as revision 0004. One ``ALTER TABLE`` adds the column (no default: nothing is
rewritten) and replaces the status constraint ``NOT VALID``, waiting at most ``LOCK_TIMEOUT``
for the table's exclusive lock, then commits; ``VALIDATE CONSTRAINT`` (SHARE UPDATE EXCLUSIVE:
writers and relays go on) and ``CREATE INDEX CONCURRENTLY`` run after it, outside any
transaction. On the partitioned layout (revision 0009), which PostgreSQL cannot index
concurrently as a whole, each partition's index is built concurrently and attached to the
parent's (:func:`outbox.partition_layout.build_index_concurrently`). A run interrupted in
between can be run again.

Downgrading refuses while messages are scheduled (an older relay would never send them):
wait until they are due, or cancel them. It deletes cancelled rows, which the older statuses
cannot hold (they were never published).

Revision ID: 0010_scheduled_messages
Revises: 0009_partitioned_layout
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import context, op

from outbox.migration_support import LOCK_TIMEOUT, current_spec, lock_outbox_table
from outbox.partition_layout import (
    SCHEDULED_INDEX_DEFINITION,
    build_index_concurrently,
    is_partitioned,
)

revision = "0010_scheduled_messages"
down_revision = "0009_partitioned_layout"
branch_labels = None
depends_on = None

_NEW_STATUSES = "('pending', 'sent', 'dead', 'prepared', 'rolled_back', 'scheduled', 'cancelled')"
_OLD_STATUSES = "('pending', 'sent', 'dead', 'prepared', 'rolled_back')"


def upgrade() -> None:
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    check = f'"{spec.table}_status_check"'
    index = f'"{spec.schema}"."{spec.scheduled_index}"'
    alter = (
        f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS deliver_at timestamp with time zone, "
        f"DROP CONSTRAINT {check}, "
        f"ADD CONSTRAINT {check} CHECK (status IN {_NEW_STATUSES}) NOT VALID"
    )
    op.execute(
        f"""
        DO $alter$
        BEGIN
            SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';
            EXECUTE {_literal(alter)};
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION '{spec.qualified_name} stayed locked by another transaction for '
                '{LOCK_TIMEOUT}: nothing was changed; run the upgrade again when no long '
                'transaction holds the table (see pg_stat_activity)';
        END
        $alter$
        """
    )
    with op.get_context().autocommit_block():
        op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {check}")
        # (Offline, the SQL is for a plain table: the partitioned layout is built online only.)
        if not context.is_offline_mode() and is_partitioned(op.get_bind(), spec):
            build_index_concurrently(
                op.get_bind(), spec, "scheduled_idx", SCHEDULED_INDEX_DEFINITION
            )
            return
        # An index left invalid by an interrupted CREATE INDEX CONCURRENTLY is made again.
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {index}")
        op.execute(
            f'CREATE INDEX CONCURRENTLY "{spec.scheduled_index}" ON {table} '
            f"{SCHEDULED_INDEX_DEFINITION}"
        )


def downgrade() -> None:
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    check = f'"{spec.table}_status_check"'
    lock_outbox_table(spec)
    # Under the lock, so that no writer schedules one after the look. Not only scheduled rows:
    # a prepared, dead or rolled-back message with a time still ahead would lose it with the
    # column, and the earlier version's commit or retry would make it pending at once.
    op.execute(
        f"""
        DO $refuse$
        BEGIN
            IF EXISTS (
                SELECT 1 FROM {table}
                WHERE status = 'scheduled'
                   OR (deliver_at > now() AND status NOT IN ('pending', 'sent', 'cancelled'))
            ) THEN
                RAISE EXCEPTION '{spec.qualified_name} holds messages not yet due (scheduled, '
                    'or prepared, dead or rolled back with a deliver_at ahead): wait until '
                    'they are due and sent, or cancel them (outbox scheduled list), first';
            END IF;
        END
        $refuse$
        """
    )
    op.execute(f"DELETE FROM {table} WHERE status = 'cancelled'")
    op.execute(f'DROP INDEX IF EXISTS "{spec.schema}"."{spec.scheduled_index}"')
    op.execute(
        f"ALTER TABLE {table} DROP CONSTRAINT {check}, "
        f"ADD CONSTRAINT {check} CHECK (status IN {_OLD_STATUSES}) NOT VALID"
    )
    op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {check}")
    op.drop_column(spec.table, "deliver_at", schema=spec.schema)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
