"""Every database operation of the relay: the loop never sees SQL."""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from outbox.relay.connections import MARK_LOCK_TIMEOUT_MS
from outbox.relay.reading import shard_window
from outbox.rows import (
    READ_COLUMNS,
    Failure,
    OutboxRows,
    PendingRow,
    id_array_literal,
    pending_row,
    pending_row_of,
)
from outbox.schema import SHARD_COUNT, OutboxTableSpec
from outbox.sending import Ack

__all__ = [
    "HELD_REACH",
    "MARK_LOCK_TIMEOUT_MS",
    "Failure",
    "HeldRow",
    "PendingRow",
    "RelayStore",
    "shard_window",
]


@dataclass(frozen=True)
class HeldRow:
    """A row another transaction holds locked: its mark waits (``pid``: the holder's backend,
    None when PostgreSQL does not say, several transactions sharing the lock say)."""

    ack: Ack
    shard: int
    pid: int | None


#: How many rows leased by immediate senders, and later rows of their keys, a read passes
#: over in one shard to fill its window with rows that may go (leases are short: a sender
#: holds at most what it sent in the last few seconds). It bounds the read's walk of a shard
#: whatever the leases.
HELD_REACH = 10_000


class RelayStore(OutboxRows):
    """Every statement the relay runs on the outbox table: the named queries of
    ``outbox/sql/queries.sql``, run for one relay (``name``).

    The relay writes nothing to a row before it is sent: the shard's advisory lock makes it the
    only relay reading the shard, and immediate senders lease their rows when they write them.
    """

    def __init__(
        self,
        engine: sa.Engine,
        spec: OutboxTableSpec,
        name: str,
        delete_on_send: bool = False,
    ) -> None:
        super().__init__(engine.url, spec, owner=None, delete_on_send=delete_on_send)
        self.engine = engine
        self.name = name
        self._compiled: dict[str, str] = {}
        #: The sessions whose read_batch columns were checked against READ_COLUMNS.
        self._checked_readers: weakref.WeakSet[psycopg.Connection] = weakref.WeakSet()

    def read_batch(
        self,
        shards: Sequence[int],
        batch_size: int,
        connection: psycopg.Connection | None = None,
        per_shard: int | None = None,
        owner_key: int | None = None,
    ) -> list[PendingRow]:
        """The next rows of ``shards`` that may go now, in order (one statement): at most
        ``batch_size`` in all and ``per_shard`` of one shard (by default twice its share).

        The relay reads on ``connection``, a session of its own, with ``owner_key``, the key
        of the session lock its owner session (the one holding the shards' advisory locks)
        took: a relay whose owner session is gone (and its shards with it) reads nothing more.
        It asks only for shards it holds (see the ``owner_alive`` query).
        """
        if not shards:
            return []
        window = per_shard or shard_window(batch_size, len(shards))
        params = {
            "shards": list(shards),
            "window": window,
            "held_reach": HELD_REACH,
            "batch_size": batch_size,
            "owner_key": owner_key,
            **self.spec.owner_session_keys,
        }
        if connection is not None:
            with connection.cursor() as cursor:
                cursor.execute(self._read_batch_sql, params)
                if connection not in self._checked_readers:
                    # Once per session: the description makes an object per column, and an
                    # empty read (most reads of a relay that keeps up) costs little else.
                    assert cursor.description is not None
                    assert tuple(c.name for c in cursor.description) == READ_COLUMNS
                    self._checked_readers.add(connection)
                return [pending_row_of(row) for row in cursor.fetchall()]
        with self.autocommit(self.engine) as conn:
            rows = conn.execute(self.queries["read_batch"], params).mappings()
            return [pending_row(row) for row in rows]

    def record_outcome(
        self,
        acks: Sequence[Ack],
        failures: Sequence[Failure] = (),
        released: Sequence[uuid.UUID] = (),
        connection: psycopg.Connection | None = None,
        owner_key: int | None = None,
    ) -> None:
        """Record what Kafka said, on the relay's ``connection`` when given.

        That is either the owner session, which holds the rows' shards, or a session beside
        it, with ``owner_key`` naming the owner session (see ``read_batch``): then nothing is
        recorded once that session is gone. Either way a relay which lost its shards (and its
        owner session) records nothing over what their next owner does.

        Failures always wait for the disk flush, also where the session's acknowledgements
        do not (see ``RelayConfig.marks_wait_for_flush``): a forgotten dead or retry mark
        would send a message again after later messages of its key went."""
        if connection is None:
            super().record_outcome(acks, failures, released)
            return
        assert not released, "the relay leases nothing to release"
        statements = self._outcome_statements(acks, failures)
        if len(statements) == 1 and not failures:  # the usual batch: one autocommit round trip
            self.mark_acked(acks, connection, owner_key)
            return
        with connection.pipeline(), connection.transaction():
            connection.execute("SET LOCAL synchronous_commit = on")
            connection.execute("SET LOCAL enable_nestloop = off")  # see hash_joins_only
            # Another transaction's row lock on one of the rows: given up after a while, the
            # whole outcome unrecorded (LockNotAvailable), so that the caller tries again.
            connection.execute(f"SET LOCAL lock_timeout = {MARK_LOCK_TIMEOUT_MS}")
            for name, params in statements:  # sent together: one round trip
                connection.execute(
                    self._psycopg_sql(name), {**params, "owner": None, "owner_key": owner_key}
                )

    def mark_acked(
        self, acks: Sequence[Ack], connection: psycopg.Connection, owner_key: int | None
    ) -> None:
        """Mark ``acks`` sent (or delete them, keep-nothing) in one autocommit statement on
        ``connection``."""
        ((name, params),) = self._outcome_statements(acks, ())
        connection.execute(
            self._psycopg_sql(name), {**params, "owner": None, "owner_key": owner_key}
        )

    def mark_unlocked(
        self, acks: Sequence[Ack], connection: psycopg.Connection, owner_key: int | None
    ) -> list[HeldRow]:
        """Mark those of ``acks`` whose rows no other transaction holds locked, waiting for no
        lock (one transaction on ``connection``); returns the rows left unmarked, held by
        another transaction. Rows gone (deleted, or marked by the
        shards' next owner) are not left: there is nothing to mark."""
        with connection.transaction():
            free, held = self._lock_unlocked([ack.id for ack in acks], connection)
            taken = [ack for ack in acks if ack.id in free]
            if taken:
                self.mark_acked(taken, connection, owner_key)
        by_id = {ack.id: ack for ack in acks}
        return [HeldRow(by_id[row_id], shard, pid) for row_id, shard, pid in held]

    def record_unlocked(
        self,
        acks: Sequence[Ack],
        failures: Sequence[Failure],
        connection: psycopg.Connection,
        owner_key: int | None,
    ) -> list[tuple[uuid.UUID, int, int | None]]:
        """Record the outcome (``acks`` and ``failures``) of the rows no other transaction
        holds locked, waiting for no lock, in one transaction on ``connection`` (a session
        beside the owner session named by ``owner_key``); returns the rows left unrecorded,
        held by another transaction: (id, shard, the holder's pid or None).

        Failures always wait for the disk flush (see ``record_outcome``)."""
        with connection.transaction():
            connection.execute("SET LOCAL synchronous_commit = on")
            connection.execute("SET LOCAL enable_nestloop = off")  # see hash_joins_only
            free, held = self._lock_unlocked(
                [*(ack.id for ack in acks), *(failure.id for failure in failures)], connection
            )
            statements = self._outcome_statements(
                [ack for ack in acks if ack.id in free],
                [failure for failure in failures if failure.id in free],
            )
            for name, params in statements:
                connection.execute(
                    self._psycopg_sql(name), {**params, "owner": None, "owner_key": owner_key}
                )
        return [(row_id, shard, pid) for row_id, shard, pid in held]

    def _lock_unlocked(
        self, ids: Sequence[uuid.UUID], connection: psycopg.Connection
    ) -> tuple[set[uuid.UUID], list[tuple[uuid.UUID, int, int | None]]]:
        """In the transaction open on ``connection``: lock those of the rows ``ids`` that no
        other transaction holds locked (skipping the others), as the mark would; returns them,
        and the rows skipped with their shard and the holder's pid."""
        literal = id_array_literal(ids)
        table = self.spec.qualified_name
        # The lock the mark itself takes: a delete conflicts with a key-share lock too.
        strength = "UPDATE" if self.delete_on_send else "NO KEY UPDATE"
        free = {
            row_id
            for (row_id,) in connection.execute(
                f"SELECT id FROM {table} WHERE id = ANY(CAST(%(ids)s AS uuid[]))"
                f" FOR {strength} SKIP LOCKED",
                {"ids": literal},
            )
        }
        # The holder is the transaction in the row's xmax (a lock shared by several names a
        # multixact instead: no pid then).
        held = connection.execute(
            f"SELECT o.id, o.shard, l.pid FROM {table} AS o"
            " LEFT JOIN pg_locks AS l ON l.locktype = 'transactionid'"
            " AND l.transactionid = o.xmax AND l.mode = 'ExclusiveLock' AND l.granted"
            " WHERE o.id = ANY(CAST(%(ids)s AS uuid[]))"
            " AND NOT (o.id = ANY(CAST(%(free)s AS uuid[])))",
            {"ids": literal, "free": id_array_literal(free)},
        ).fetchall()
        return free, [(row_id, shard, pid) for row_id, shard, pid in held]

    def owner_alive(self, session: psycopg.Connection, owner_key: int) -> bool:
        """Whether ``session`` sees the owner session that locked ``owner_key`` as alive."""
        row = session.execute(
            self._psycopg_sql("owner_alive"),
            {"owner_key": owner_key, **self.spec.owner_session_keys},
        ).fetchone()
        return row is not None and bool(row[0])

    def leases_held(self, shards: Sequence[int], connection: psycopg.Connection) -> bool:
        """Whether an immediate sender holds pending rows of ``shards``."""
        if not shards:
            return False
        row = connection.execute(
            self._psycopg_sql("leases_held"), {"shards": list(shards)}
        ).fetchone()
        return row is not None and bool(row[0])

    @property
    def _read_batch_sql(self) -> str:
        return self._psycopg_sql("read_batch")

    def _psycopg_sql(self, name: str) -> str:
        """A named query as psycopg's own SQL (``%(name)s`` placeholders), compiled once."""
        compiled = self._compiled.get(name)
        if compiled is None:
            dialect = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]
            compiled = self._compiled[name] = str(self.queries[name].compile(dialect=dialect))
        return compiled

    def mark_committed(self, acks: Sequence[Ack]) -> int:
        """Exactly-once recovery: mark rows whose Kafka transaction is known committed."""
        if not acks:
            return 0
        with self.marking_engine.begin() as conn:
            if self.delete_on_send:
                ids = [a.id for a in acks]
                return int(conn.execute(self.queries["delete_committed"], {"ids": ids}).rowcount)
            result = conn.execute(
                self.queries["mark_sent_unleased"],
                {
                    "ids": [a.id for a in acks],
                    "partitions": [a.partition for a in acks],
                    "offsets": [a.offset for a in acks],
                    "generations": [a.generation for a in acks],
                },
            )
        return int(result.rowcount)

    def break_leases(
        self, shards: Sequence[int], connection: psycopg.Connection | None = None
    ) -> int:
        """A new owner of ``shards`` frees rows that relays of earlier versions had leased
        (on ``connection`` when given, waiting at most MARK_LOCK_TIMEOUT_MS for a row lock)."""
        params = {"shards": list(shards), "owner": self.name}
        if connection is not None:
            with connection.transaction():
                connection.execute(f"SET LOCAL lock_timeout = {MARK_LOCK_TIMEOUT_MS}")
                cursor = connection.execute(self._psycopg_sql("break_relay_leases"), params)
                return max(0, cursor.rowcount)
        with self.engine.begin() as conn:
            result = conn.execute(self.queries["break_relay_leases"], params)
        return int(result.rowcount)

    def oldest_pending_age(self, connection: psycopg.Connection | None = None) -> float:
        """Seconds since the oldest pending row was written (one index probe per shard)."""
        params = {"shard_count": SHARD_COUNT}
        if connection is not None:
            row = connection.execute(self._psycopg_sql("oldest_pending"), params).fetchone()
            return float(row[0]) if row is not None else 0.0
        with self.engine.connect() as conn:
            return float(conn.execute(self.queries["oldest_pending"], params).scalar_one())
