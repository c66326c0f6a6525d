"""The lease index: pending rows an immediate sender holds, by key.

``<table>_lease_idx`` holds the pending rows leased to an immediate sender (few: what the
senders sent in the last moments). The relay's read passes over them and over the later rows
of their keys, which must wait for them, before it counts a shard's window: a key held by a
sender, however long its backlog behind it, hides no other key's rows. Without the index that
needs a walk of every pending row of the key.

Locks: ``CREATE INDEX CONCURRENTLY`` outside any transaction (SHARE UPDATE EXCLUSIVE: writers
and the relay go on). A run interrupted in between can be run again. The downgrade drops the
index inside the revision's transaction (so that a downgrade refused further down, by
0004, leaves it in place with the version that says so), after the table's exclusive lock,
waited for at most ``LOCK_TIMEOUT``.

Revision ID: 0008_lease_index
Revises: 0007_check_failures
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

from outbox.migration_support import current_spec, lock_outbox_table

revision = "0008_lease_index"
down_revision = "0007_check_failures"
branch_labels = None
depends_on = None


def upgrade() -> None:
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    index = f'"{spec.schema}"."{spec.lease_index}"'
    with op.get_context().autocommit_block():
        # An index left invalid by an interrupted CREATE INDEX CONCURRENTLY is made again.
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {index}")
        op.execute(
            f'CREATE INDEX CONCURRENTLY "{spec.lease_index}" ON {table} '
            "(shard, topic, key, seq) WHERE status = 'pending' AND lease_until IS NOT NULL"
        )


def downgrade() -> None:
    spec = current_spec()
    lock_outbox_table(spec)
    op.execute(f'DROP INDEX IF EXISTS "{spec.schema}"."{spec.lease_index}"')
