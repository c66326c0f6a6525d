"""Prepared messages: a rolled-back message remembers the idempotency key it gave up.

A rollback gives the message's idempotency key up (a retry with the key is a new message).
``released_idempotency_key`` keeps that key, so that a commit after the rollback
(``outbox prepared commit --after-rollback``) can tell whether a retry took the key since
(then it refuses: the event would be published twice) and, when none did, takes it back.

Messages rolled back before the upgrade gave their keys up without a trace: a commit after
their rollback cannot tell.

The column has no default: adding it rewrites nothing, and the ALTER TABLE holds the table's
lock for a moment only (waiting at most ``outbox.migration_support.LOCK_TIMEOUT`` for it,
then failing with nothing changed). The downgrade drops the column (and what it kept).

Revision ID: 0011_released_idempotency_keys
Revises: 0010_scheduled_messages
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

from outbox.migration_support import current_spec, lock_outbox_table

revision = "0011_released_idempotency_keys"
down_revision = "0010_scheduled_messages"
branch_labels = None
depends_on = None


def upgrade() -> None:
    spec = current_spec()
    lock_outbox_table(spec)
    op.execute(
        f'ALTER TABLE "{spec.schema}"."{spec.table}" '
        "ADD COLUMN IF NOT EXISTS released_idempotency_key text"
    )


def downgrade() -> None:
    spec = current_spec()
    lock_outbox_table(spec)
    op.execute(
        f'ALTER TABLE "{spec.schema}"."{spec.table}" DROP COLUMN IF EXISTS released_idempotency_key'
    )
