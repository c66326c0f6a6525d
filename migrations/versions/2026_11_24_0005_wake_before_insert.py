"""The wake trigger fires before each insert statement instead of after it.

The trigger only takes the wake lock and, when a relay sleeps, queues a NOTIFY; neither
needs the inserted rows. Fired after the statement, PostgreSQL also queues an after-trigger
event per statement and runs it at the statement's end; fired before, the call is all it
costs. The wake lock is taken before the rows exist and held to commit either way, so the
handshake of revision 0003 is unchanged (docs/relay.md, "Waking the relay"). Dropping and
creating the trigger in one transaction leaves no moment without it.

Revision ID: 0005_wake_before_insert
Revises: 0004_prepared_messages
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

from outbox.migration_support import current_spec, lock_outbox_table

revision = "0005_wake_before_insert"
down_revision = "0004_prepared_messages"
branch_labels = None
depends_on = None


def _recreate(when: str) -> None:
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    function = f'"{spec.schema}"."{spec.wake_function}"'
    lock_outbox_table(spec)  # waits a bounded time, or fails with nothing changed
    op.execute(f'DROP TRIGGER IF EXISTS "{spec.wake_function}" ON {table}')
    op.execute(
        f'CREATE TRIGGER "{spec.wake_function}" {when} INSERT ON {table} '
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
    )


def upgrade() -> None:
    _recreate("BEFORE")


def downgrade() -> None:
    _recreate("AFTER")
