"""What the server must allow before a WAL reader starts: each refusal one line, at start.

Checked in the order an operator fixes them: the server's version, the WAL level (a
restart), the role's right to replicate, then room for the slot and for its stream.
"""

from __future__ import annotations

from outbox.wal.errors import (
    NoFreeSlot,
    NoFreeWalSender,
    ReplicationNotPermitted,
    ServerTooOld,
    SlotInUse,
    WalLevelNotLogical,
)
from outbox.wal.slots import Connection, slot_state


def check_server(conn: Connection, slot: str) -> None:
    """Raise the first reason ``slot`` cannot be read over ``conn``'s server and role."""
    check_version(conn)
    check_wal_level(conn)
    check_replication_role(conn)
    check_slot_room(conn, slot)


#: PostgreSQL 15: publications with column lists and row filters.
MIN_SERVER_VERSION = 150000


def check_version(conn: Connection) -> None:
    row = conn.execute(
        "SELECT current_setting('server_version_num')::int, current_setting('server_version')"
    ).fetchone()
    assert row is not None
    refusal = version_refusal(row[0], row[1])
    if refusal:
        raise ServerTooOld(refusal)


def version_refusal(version_num: int, version: str) -> str | None:
    """Why a server of ``version_num`` (``server_version_num``) cannot serve, or None."""
    if version_num >= MIN_SERVER_VERSION:
        return None
    return (
        f"PostgreSQL {version} is too old for the WAL source: it needs 15 or later "
        "(publications with column lists and row filters)"
    )


def check_wal_level(conn: Connection) -> None:
    row = conn.execute("SELECT current_setting('wal_level')").fetchone()
    level = row[0] if row else None
    if level != "logical":
        raise WalLevelNotLogical(
            f"wal_level is {level!r}, not 'logical': set wal_level = logical in "
            "postgresql.conf (on Amazon RDS: rds.logical_replication = 1) and restart PostgreSQL"
        )


def check_replication_role(conn: Connection) -> None:
    row = conn.execute(
        "SELECT current_user, r.rolreplication OR r.rolsuper OR COALESCE(("
        "  SELECT pg_has_role(current_user, oid, 'MEMBER') FROM pg_roles"
        "  WHERE rolname = 'rds_replication'), false)"
        " FROM pg_roles r WHERE r.rolname = current_user"
    ).fetchone()
    assert row is not None
    user, allowed = row
    if not allowed:
        raise ReplicationNotPermitted(
            f"role {user} may not read a replication slot: ALTER ROLE {user} REPLICATION "
            f"(on Amazon RDS: GRANT rds_replication TO {user})"
        )


def check_slot_room(conn: Connection, slot: str) -> None:
    """A slot to create needs a free one of ``max_replication_slots``; a slot to stream, a
    free WAL sender and nobody else reading it."""
    state = slot_state(conn, slot)
    row = conn.execute(
        "SELECT current_setting('max_replication_slots')::int,"
        " (SELECT count(*) FROM pg_replication_slots),"
        " current_setting('max_wal_senders')::int,"
        " (SELECT count(*) FROM pg_stat_replication)"
    ).fetchone()
    assert row is not None
    max_slots, slots, max_senders, senders = row
    if state is None and slots >= max_slots:
        raise NoFreeSlot(
            f"no free replication slot for {slot}: all {max_slots} (max_replication_slots) "
            "are taken; drop one no longer read (pg_drop_replication_slot) or raise "
            "max_replication_slots (a restart)"
        )
    if state is not None and state.active_pid is not None:
        raise SlotInUse(
            f"replication slot {slot} is read by another session (pid {state.active_pid}); "
            "one reader at a time"
        )
    if senders >= max_senders:
        raise NoFreeWalSender(
            f"no free WAL sender for {slot}: all {max_senders} (max_wal_senders) stream to "
            "someone already; raise max_wal_senders (a restart)"
        )
