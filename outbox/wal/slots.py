"""The outbox's publication and replication slot: their names, making them, looking at them.

One publication and one slot per outbox table, both named after it
(``outbox_<schema>_<table>``). The publication carries the table's inserts of pending
messages only (prepared and scheduled rows become pending by an update, which it does not
carry: those stay the table's), and only the columns a relay sends
(:data:`PUBLISHED_COLUMNS`); a partitioned outbox table's rows come as the table's own
(``publish_via_partition_root``). The outbox rows stay the durable record, the slot is the
fast way to learn of them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox.errors import PermissionDenied
from outbox.schema import PENDING, OutboxTableSpec
from outbox.wal.errors import PublicationMismatch
from outbox.wal.pgoutput import PUBLISHED_COLUMNS

#: The output plugin: PostgreSQL's own, the one logical replication uses (no extension).
PLUGIN = "pgoutput"
_MAX_NAME = 63

Connection = psycopg.Connection[Any]


def slot_name(spec: OutboxTableSpec) -> str:
    """The slot's (and the publication's) name for the outbox table of ``spec``."""
    name = f"outbox_{spec.schema}_{spec.table}"
    if len(name) > _MAX_NAME:
        name = f"outbox_{spec.table}_{zlib.crc32(spec.qualified_name.encode()):08x}"
    return name


def stream_options(spec: OutboxTableSpec) -> dict[str, str]:
    """``pgoutput``'s options for the outbox's stream: binary values, no logical messages."""
    return {"proto_version": "1", "publication_names": slot_name(spec), "binary": "true"}


def ensure_publication(conn: Connection, spec: OutboxTableSpec) -> None:
    """Create the outbox's publication if missing; check the one there publishes what the
    decoder reads (:class:`PublicationMismatch` otherwise)."""
    name = slot_name(spec)
    found = conn.execute(
        "SELECT pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot FROM pg_publication"
        " WHERE pubname = %s",
        (name,),
    ).fetchone()
    if found is None:
        _create_publication(conn, spec, name)
        return
    if tuple(found) != (True, False, False, False, True):
        raise PublicationMismatch(
            f"publication {name} publishes more than inserts, or a partitioned table's rows "
            "as its partitions' (publish_via_partition_root off): "
            f"DROP PUBLICATION {name} and let the reader make it again"
        )
    tables = conn.execute(
        "SELECT schemaname, tablename, attnames, rowfilter FROM pg_publication_tables"
        " WHERE pubname = %s",
        (name,),
    ).fetchall()
    expected = [(spec.schema, spec.table, list(PUBLISHED_COLUMNS))]
    if [tuple(t[:3]) for t in tables] != [tuple(e) for e in expected] or not tables[0][3]:
        raise PublicationMismatch(
            f"publication {name} does not publish {spec.qualified_name}'s pending inserts "
            f"({', '.join(PUBLISHED_COLUMNS)}) alone: DROP PUBLICATION {name} and let the "
            "reader make it again"
        )


def _create_publication(conn: Connection, spec: OutboxTableSpec, name: str) -> None:
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in PUBLISHED_COLUMNS)
    statement = sql.SQL(
        "CREATE PUBLICATION {} FOR TABLE {}.{} ({}) WHERE (status = {})"
        " WITH (publish = 'insert', publish_via_partition_root = true)"
    ).format(
        sql.Identifier(name),
        sql.Identifier(spec.schema),
        sql.Identifier(spec.table),
        columns,
        sql.Literal(PENDING),
    )
    try:
        conn.execute(statement)
    except psycopg.errors.InsufficientPrivilege as error:
        raise PermissionDenied(
            f"cannot create publication {name}: it takes the owner of {spec.qualified_name} "
            f"and CREATE on the database (or, as that owner: {statement.as_string(conn)})"
        ) from error
    except psycopg.errors.DuplicateObject:
        pass  # another reader made it meanwhile


@dataclass(frozen=True)
class SlotState:
    """A slot as ``pg_replication_slots`` shows it, and the WAL it holds back."""

    name: str
    plugin: str | None
    database: str | None
    #: The backend reading it (None: nobody).
    active_pid: int | None
    #: reserved, extended, unreserved or lost (PostgreSQL 13+); lost: its WAL is gone.
    wal_status: str | None
    restart_lsn: int | None
    confirmed_flush_lsn: int | None
    #: Bytes of WAL kept for the slot (from its restart position to the current one).
    held_bytes: int | None
    #: Bytes more it may hold before ``max_slot_wal_keep_size`` invalidates it (None: no limit).
    safe_bytes: int | None


_STATE = """
SELECT slot_name, plugin, database, active_pid, wal_status,
       (restart_lsn - '0/0'::pg_lsn)::bigint,
       (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint,
       (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END
        - restart_lsn)::bigint,
       safe_wal_size
FROM pg_replication_slots WHERE slot_name = %s
"""


def slot_state(conn: Connection, name: str) -> SlotState | None:
    """The slot named ``name``, or None when there is none."""
    row = conn.execute(_STATE, (name,)).fetchone()
    return None if row is None else SlotState(*row)


def create_slot(conn: Connection, name: str) -> int:
    """Create the logical slot ``name``; returns the position it starts from."""
    row = conn.execute(
        "SELECT (lsn - '0/0'::pg_lsn)::bigint FROM pg_create_logical_replication_slot(%s, %s)",
        (name, PLUGIN),
    ).fetchone()
    assert row is not None
    return int(row[0])


def drop_slot(conn: Connection, name: str) -> None:
    """Drop the slot ``name`` if there is one (nobody may be reading it)."""
    conn.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
        (name,),
    )
