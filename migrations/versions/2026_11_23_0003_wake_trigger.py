"""Wake relays only while one sleeps: a statement trigger replaces the NOTIFY rule.

Every NOTIFY makes its transaction take a database-wide lock at commit, held through the
commit record's flush, so concurrent writers that all notify commit one after another and
lose group commit. Here a writer notifies only when a relay is asleep: the trigger asks for
the table's wake lock in shared mode (free, and held to commit, while relays are busy) and
notifies only when an idle relay holds it exclusively. docs/relay.md ("Waking the relay")
explains the handshake that makes sure no commit is missed.

Revision ID: 0003_wake_trigger
Revises: 0002_generation_retry_idx
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

from outbox.migration_support import current_spec, lock_outbox_table

revision = "0003_wake_trigger"
down_revision = "0002_generation_retry_idx"
branch_labels = None
depends_on = None


def upgrade() -> None:
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    function = f'"{spec.schema}"."{spec.wake_function}"'
    space, number = spec.wake_lock
    lock_outbox_table(spec)  # waits a bounded time, or fails with nothing changed
    op.execute(f'DROP RULE IF EXISTS "{spec.notify_rule}" ON {table}')
    # Names are schema-qualified so that the caller's search_path cannot redirect them.
    op.execute(
        f"""
        CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $wake$
        BEGIN
            IF NOT pg_catalog.pg_try_advisory_xact_lock_shared({space}, {number}) THEN
                PERFORM pg_catalog.pg_notify('{spec.notify_channel}', '');
            END IF;
            RETURN NULL;
        END
        $wake$
        """
    )
    # Once per statement, not per row; unlike a rule it also fires for COPY.
    op.execute(
        f'CREATE TRIGGER "{spec.wake_function}" AFTER INSERT ON {table} '
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
    )


def downgrade() -> None:
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    lock_outbox_table(spec)
    op.execute(f'DROP TRIGGER IF EXISTS "{spec.wake_function}" ON {table}')
    op.execute(f'DROP FUNCTION IF EXISTS "{spec.schema}"."{spec.wake_function}"()')
    op.execute(
        f'CREATE RULE "{spec.notify_rule}" AS ON INSERT TO {table} '
        f'DO ALSO NOTIFY "{spec.notify_channel}"'
    )
