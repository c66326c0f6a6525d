"""The wake trigger asks for the wake lock in its WHEN condition, not in a PL/pgSQL body.

With relays busy (the usual case under load) the trigger's only work is the shared wake
lock, and a PL/pgSQL call per insert statement cost more than the lock: at 16 and 64
concurrent writers the outbox table reached 0.90-0.95 of a table of the same shape without
a trigger. A WHEN condition is a plain expression the executor evaluates itself: the lock is
asked for there, and the function (now only the NOTIFY) runs only when the lock is refused,
that is when a relay sleeps. The handshake of revision 0003 is unchanged (docs/relay.md,
"Waking the relay"): the lock is still taken before the statement's rows and kept to commit.
The function and the trigger are replaced in one transaction: no moment without a wake-up.
Replacing the trigger needs the table's exclusive lock: the migration waits at most
outbox.migration_support.LOCK_TIMEOUT for it (a transaction left open on the table would
otherwise queue every reader and writer behind the migration) and fails with nothing changed.

Revision ID: 0006_wake_lock_in_condition
Revises: 0005_wake_before_insert
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

from outbox.migration_support import current_spec, lock_outbox_table

revision = "0006_wake_lock_in_condition"
down_revision = "0005_wake_before_insert"
branch_labels = None
depends_on = None


def _replace(body: str, condition: str) -> None:
    """Replace the wake function's body and the trigger (fired before each insert statement,
    with ``condition`` as its WHEN clause, or none) in the migration's one transaction."""
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    function = f'"{spec.schema}"."{spec.wake_function}"'
    space, number = spec.wake_lock
    notify = f"pg_catalog.pg_notify('{spec.notify_channel}', '')"
    lock = f"pg_catalog.pg_try_advisory_xact_lock_shared({space}, {number})"
    lock_outbox_table(spec)
    op.execute(f'DROP TRIGGER IF EXISTS "{spec.wake_function}" ON {table}')
    op.execute(
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $wake$\n"
        f"BEGIN\n{body.format(notify=notify, lock=lock)}\nRETURN NULL;\nEND\n$wake$"
    )
    when = f"WHEN ({condition.format(lock=lock)}) " if condition else ""
    op.execute(
        f'CREATE TRIGGER "{spec.wake_function}" BEFORE INSERT ON {table} FOR EACH STATEMENT '
        f"{when}EXECUTE FUNCTION {function}()"
    )


def upgrade() -> None:
    # The lock in the WHEN condition; the function, only the NOTIFY, runs when it is refused.
    _replace("PERFORM {notify};", "NOT {lock}")


def downgrade() -> None:
    # Revision 0005: the function takes the lock and notifies when it is refused.
    _replace("IF NOT {lock} THEN\n    PERFORM {notify};\nEND IF;", "")
