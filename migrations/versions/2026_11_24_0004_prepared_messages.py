"""Prepared messages with check-back: two more statuses, the check columns, their index.

A prepared message is a row with status ``prepared``: the relay reads only pending rows, so it
never sees it. Its producer commits it (it becomes ``pending``) or rolls it back
(``rolled_back``, final); when that word is lost, a check-back runner asks the service's
checker. The new columns record when the message was prepared, the name its checker is
registered under, when it is checked next, every check, and how it ended.
``<table>_prepared_idx`` holds the prepared rows only (few), in the order the runners take them.

Locks: Alembic runs a revision in one transaction, and the first ALTER TABLE takes ACCESS
EXCLUSIVE on the table (no reader, no writer) until that transaction ends. So that ends
quickly: one ALTER TABLE adds the columns (no default or a constant one: nothing is rewritten)
and replaces the status constraint ``NOT VALID`` (nothing is read), waiting at most
``LOCK_TIMEOUT`` for the lock (a long transaction on the table makes it fail with a clear
error rather than queue every writer behind it), then commits. The full-table scans run after
it, outside any transaction: ``VALIDATE CONSTRAINT`` (SHARE UPDATE EXCLUSIVE: writers and the
relay go on) and ``CREATE INDEX CONCURRENTLY``. A run interrupted in between can be run again.

Downgrading refuses while messages wait for a verdict (prepared, or left dead by check-back
as ``unresolved``: the older ``outbox dead retry`` would publish those): commit or roll them
back first. It deletes rolled-back rows, which the older statuses cannot hold (they were never
published).

Revision ID: 0004_prepared_messages
Revises: 0003_wake_trigger
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

from outbox.migration_support import current_spec

revision = "0004_prepared_messages"
down_revision = "0003_wake_trigger"
branch_labels = None
depends_on = None

_NEW_STATUSES = "('pending', 'sent', 'dead', 'prepared', 'rolled_back')"
_OLD_STATUSES = "('pending', 'sent', 'dead')"


#: Longest wait for the table's lock before the ALTER TABLE gives up.
LOCK_TIMEOUT = "5s"

_COLUMNS = (
    ("prepared_at", "timestamp with time zone"),
    ("check_group", "text"),
    ("next_check_at", "timestamp with time zone"),
    ("check_count", "integer NOT NULL DEFAULT 0"),
    ("last_checked_at", "timestamp with time zone"),
    ("last_check_answer", "text"),
    ("last_check_error", "text"),
    ("resolved_at", "timestamp with time zone"),
    ("resolved_by", "text"),
)


def upgrade() -> None:
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    check = f'"{spec.table}_status_check"'
    index = f'"{spec.schema}"."{spec.prepared_index}"'
    changes = [f"ADD COLUMN IF NOT EXISTS {name} {kind}" for name, kind in _COLUMNS]
    changes += [
        f"DROP CONSTRAINT {check}",
        f"ADD CONSTRAINT {check} CHECK (status IN {_NEW_STATUSES}) NOT VALID",
    ]
    _locked_alter(spec.qualified_name, f"ALTER TABLE {table} " + ", ".join(changes))
    with op.get_context().autocommit_block():
        op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {check}")
        # An index left invalid by an interrupted CREATE INDEX CONCURRENTLY is made again.
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {index}")
        op.execute(
            f'CREATE INDEX CONCURRENTLY "{spec.prepared_index}" ON {table} '
            "(check_group, next_check_at) WHERE status = 'prepared'"
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
            IF EXISTS (SELECT 1 FROM {table}
                        WHERE status = 'dead' AND error_kind = 'unresolved') THEN
                RAISE EXCEPTION '{spec.qualified_name} holds prepared messages that check-back '
                    'left dead without a verdict: commit or roll them back first (outbox '
                    'prepared list); the older version would publish them with outbox dead retry';
            END IF;
        END
        $refuse$
        """
    )
    op.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
    op.execute(f"DELETE FROM {table} WHERE status = 'rolled_back'")
    op.drop_index(spec.prepared_index, table_name=spec.table, schema=spec.schema)
    _replace_status_check(_OLD_STATUSES)
    for name, _ in reversed(_COLUMNS):
        op.drop_column(spec.table, name, schema=spec.schema)


def _locked_alter(name: str, statement: str) -> None:
    """``statement``, waiting at most ``LOCK_TIMEOUT`` for the table's lock, or a clear error."""
    op.execute(
        f"""
        DO $alter$
        BEGIN
            SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';
            EXECUTE {_literal(statement)};
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION '{name} stayed locked by another transaction for {LOCK_TIMEOUT}: '
                'nothing was changed; run the upgrade again when no long transaction holds '
                'the table (see pg_stat_activity)';
        END
        $alter$
        """
    )


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _replace_status_check(statuses: str) -> None:
    spec = current_spec()
    table = f'"{spec.schema}"."{spec.table}"'
    name = f'"{spec.table}_status_check"'
    op.execute(
        f"ALTER TABLE {table} DROP CONSTRAINT {name}, "
        f"ADD CONSTRAINT {name} CHECK (status IN {statuses}) NOT VALID"
    )
    op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")
