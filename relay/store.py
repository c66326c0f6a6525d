"""Every database operation of the relay: the loop never sees SQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from outbox.engines import sender_engine
from outbox.queries import Queries
from outbox.records import OutboxRecord
from outbox.schema import SHARD_COUNT, OutboxTableSpec
from outbox.sending import Ack
from relay.policy import UNDECODABLE


@dataclass(frozen=True)
class Leased:
    """A leased row: the record to produce, or why it cannot be one."""

    id: uuid.UUID
    shard: int
    attempts: int
    created_at: datetime
    record: OutboxRecord | None
    problem: str | None = None


@dataclass(frozen=True)
class Failure:
    id: uuid.UUID
    kind: str
    error: str
    delay: float | None  # seconds until the next attempt; None makes the row dead


class RelayStore:
    """Named queries of ``outbox/sql/queries.sql`` run for one relay (``owner``)."""

    def __init__(
        self, engine: sa.Engine, spec: OutboxTableSpec, owner: str, delete_on_send: bool = False
    ) -> None:
        self.engine = engine
        # Marking joins the table to arrays of the batch's ids: hash joins only (see
        # outbox.engines.hash_joins_only), set once per session instead of per transaction.
        self.marking_engine = sender_engine(engine.url, nested_loops=False)
        self.delete_on_send = delete_on_send
        self.queries = Queries(spec)
        self.owner = owner

    def lease_batch(
        self, shards: Sequence[int], batch_size: int, lease_seconds: float
    ) -> list[Leased]:
        """Lease the next rows of ``shards`` in order, then drop any that would overtake an
        earlier row of their key held elsewhere (possible only while shards change hands)."""
        if not shards:
            return []
        window = max(100, 2 * batch_size // len(shards))
        with self._autocommit(self.engine) as conn:  # one statement: one round trip
            rows = (
                conn.execute(
                    self.queries["lease_batch"],
                    {
                        "shards": list(shards),
                        "window": window,
                        "batch_size": batch_size,
                        "owner": self.owner,
                        "lease_seconds": lease_seconds,
                    },
                )
                .mappings()
                .all()
            )
        if not rows:
            return []
        ids = [row["id"] for row in rows]
        with self._autocommit(self.engine) as conn:
            blocked = set(
                conn.execute(
                    self.queries["leased_behind_earlier"],
                    {"ids": ids, "owner": self.owner, "reach": window},
                ).scalars()
            )
            if blocked:
                conn.execute(self.queries["release"], {"ids": list(blocked), "owner": self.owner})
        return [
            _leased(row) for row in sorted(rows, key=lambda r: r["seq"]) if row["id"] not in blocked
        ]

    def record_outcome(self, acks: Sequence[Ack], failures: Sequence[Failure]) -> None:
        """Mark acknowledged rows sent and failed ones for retry or dead, in one transaction."""
        retry = [f for f in failures if f.delay is not None]
        dead = [f for f in failures if f.delay is None]
        statements: list[tuple[str, dict[str, Any]]] = []
        if acks and self.delete_on_send:
            statements.append(("delete_sent", {"ids": [a.id for a in acks]}))
        elif acks:
            statements.append(
                (
                    "mark_sent",
                    {
                        "ids": [a.id for a in acks],
                        "partitions": [a.partition for a in acks],
                        "offsets": [a.offset for a in acks],
                    },
                )
            )
        if retry:
            statements.append(
                (
                    "mark_retry",
                    {
                        "ids": [f.id for f in retry],
                        "delays": [f.delay for f in retry],
                        "kinds": [f.kind for f in retry],
                        "errors": [f.error[:2000] for f in retry],
                    },
                )
            )
        if dead:
            statements.append(
                (
                    "mark_dead",
                    {
                        "ids": [f.id for f in dead],
                        "kinds": [f.kind for f in dead],
                        "errors": [f.error[:2000] for f in dead],
                    },
                )
            )
        if not statements:
            return
        # The usual batch is all sent: one statement, run without BEGIN/COMMIT round trips.
        scope = (
            self._autocommit(self.marking_engine)
            if len(statements) == 1
            else self.marking_engine.begin()
        )
        with scope as conn:
            for name, params in statements:
                conn.execute(self.queries[name], {**params, "owner": self.owner})

    def release(self, ids: Sequence[uuid.UUID]) -> None:
        """Give leased rows back untouched (shutdown, or a batch not attempted)."""
        if ids:
            with self.engine.begin() as conn:
                conn.execute(self.queries["release"], {"ids": list(ids), "owner": self.owner})

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

    def break_leases(self, shards: Sequence[int]) -> int:
        """A new owner of ``shards`` takes back what earlier relay owners had leased."""
        with self.engine.begin() as conn:
            result = conn.execute(
                self.queries["break_relay_leases"], {"shards": list(shards), "owner": self.owner}
            )
        return int(result.rowcount)

    def oldest_pending_age(self) -> float:
        """Seconds since the oldest pending row was written (one index probe per shard)."""
        with self.engine.connect() as conn:
            query = self.queries["oldest_pending"]
            return float(conn.execute(query, {"shard_count": SHARD_COUNT}).scalar_one())

    def close(self) -> None:
        self.marking_engine.dispose()

    @staticmethod
    @contextmanager
    def _autocommit(engine: sa.Engine) -> Iterator[sa.Connection]:
        with engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")


def _leased(row: Any) -> Leased:
    try:
        record: OutboxRecord | None = OutboxRecord.from_row(dict(row))
        problem = None
    except (ValueError, TypeError, UnicodeError) as error:
        record, problem = None, f"{UNDECODABLE}: {error}"
    return Leased(
        id=row["id"],
        shard=row["shard"],
        attempts=row["attempts"],
        created_at=row["created_at"],
        record=record,
        problem=problem,
    )
