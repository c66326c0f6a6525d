"""Prepared messages: checks that failed (the checker raised or timed out) are counted apart.

A failed check says nothing about the business step: it must never, by itself, end a message
as rolled back. ``check_failures`` counts those among ``check_count``, so that check-back
rolls a message back at ``max_checks`` only when every check answered UNKNOWN, and leaves it
dead for an operator otherwise.

A prepared message whose last check before the upgrade failed counts one failed check.

The column has a constant default: adding it rewrites nothing, and the ALTER TABLE holds the
table's lock for a moment only (waiting at most
``outbox.migration_support.LOCK_TIMEOUT`` for it, then failing with nothing changed).

Revision ID: 0007_check_failures
Revises: 0006_wake_lock_in_condition
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

from outbox.migration_support import current_spec, lock_outbox_table

revision = "0007_check_failures"
down_revision = "0006_wake_lock_in_condition"
branch_labels = None
depends_on = None


def upgrade() -> None:
    spec = current_spec()
    lock_outbox_table(spec)
    op.execute(
        f'ALTER TABLE "{spec.schema}"."{spec.table}" '
        "ADD COLUMN IF NOT EXISTS check_failures integer NOT NULL DEFAULT 0"
    )
    # A message whose last check before the upgrade failed keeps that failure (earlier
    # answers were not kept): check-back must not end it rolled back. Few rows: the
    # prepared ones, through their partial index.
    op.execute(
        f'UPDATE "{spec.schema}"."{spec.table}" SET check_failures = 1 '
        "WHERE status = 'prepared' AND last_check_answer IN ('error', 'timeout')"
    )


def downgrade() -> None:
    spec = current_spec()
    lock_outbox_table(spec)
    op.execute(f'ALTER TABLE "{spec.schema}"."{spec.table}" DROP COLUMN check_failures')
