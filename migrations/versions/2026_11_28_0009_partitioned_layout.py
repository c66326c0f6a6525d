"""The partitioned layout, for tables created with it (retention without DELETE).

When the upgrade is asked for it (``outbox db upgrade --partitioned daily``, ``-x
outbox_partitioned=hourly`` or ``OUTBOX_PARTITIONED``), the table is rebuilt partitioned by
day or hour of its message ids, with a side table for the idempotency keys
(:mod:`outbox.partition_layout`, docs/retention.md). The rows are copied under the table's
exclusive lock (waiting at most ``outbox.migration_support.LOCK_TIMEOUT`` for it): meant for a
new table or a small one. Otherwise this revision changes nothing.

The downgrade rebuilds a partitioned table as a plain one (rows copied the same way). Both
directions read the table, so neither prints SQL offline (``--sql``).

Revision ID: 0009_partitioned_layout
Revises: 0008_lease_index
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import context, op

from outbox.errors import OutboxError
from outbox.migration_support import current_partitioning, current_spec, lock_outbox_table
from outbox.partition_layout import check_interval, convert

revision = "0009_partitioned_layout"
down_revision = "0008_lease_index"
branch_labels = None
depends_on = None


def upgrade() -> None:
    interval = current_partitioning()
    if interval is None:
        return
    if context.is_offline_mode():
        raise OutboxError("the partitioned layout is built from the table's rows: run it online")
    spec = current_spec()
    lock_outbox_table(spec)
    convert(op.get_bind(), spec, partitioned=True, interval=check_interval(interval))


def downgrade() -> None:
    if context.is_offline_mode():
        return  # a plain table has nothing to undo; a partitioned one is rebuilt online only
    spec = current_spec()
    lock_outbox_table(spec)
    convert(op.get_bind(), spec, partitioned=False)
