"""Scheduled messages fall in line: the relay makes the due scheduled rows of its shards pending.

A scheduled row (status ``scheduled``, see docs/scheduled.md) is not in the pending index, so
the relay's read never sees it, however many wait. Before it reads, the relay makes the due
scheduled rows of the shards it owns pending, each with a new seq, in the order they fell due
(then their old seq), in one short transaction on its reading session: they take their place
in their keys' order then, as committed prepared messages do. With nothing due that costs
two probes of the scheduled index per shard (its due end, and the first entry ahead).

A due row another transaction holds locked (a cancel in progress, inside a business
transaction that may still roll back) is skipped, and so are its key's later due rows
(:func:`promotable`): promoted past it, they would take lower seqs and go first. The look is
made again at the next look allowed, also by an idle relay: a cancel that rolls back is sent
about that long after.

The look is made at most every :data:`~outbox.relay.reading.RELOOK_SECONDS` (a busy relay
reads every few milliseconds), and at once when the next due time it learned has come or its
shards changed. An idle relay sleeps no longer than until that time: it wakes for the next
due message instead of polling for it. When a look was skipped since the last one made (a
commit woke the relay: it may have scheduled a message due sooner), the sleep ends at the
next look allowed.

Exactly-once needs nothing more: the promotion commits before the read that takes the rows,
which are then pending rows like any other. A relay killed between the two leaves them pending
for the next owner of their shard; none of them is in a progress record yet.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

import psycopg
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from outbox.queries import Queries
from outbox.relay.observability import RelayMetrics
from outbox.relay.reading import RELOOK_SECONDS
from outbox.schema import SHARD_COUNT, OutboxTableSpec


@dataclass(frozen=True)
class DueRow:
    """A due scheduled row, as the promotion sees it."""

    id: uuid.UUID
    deliver_at: datetime
    seq: int
    topic: str
    key: bytes | None


def promotable(due: Sequence[DueRow], free: Collection[uuid.UUID]) -> list[DueRow]:
    """The rows of ``due`` (in due order) to make pending now: those ``free`` of other
    transactions' locks, but for a key's rows after its first locked one."""
    stopped: set[tuple[str, bytes]] = set()
    going = []
    for row in due:
        key = None if row.key is None else (row.topic, row.key)
        if row.id not in free:
            if key is not None:
                stopped.add(key)
        elif key is None or key not in stopped:
            going.append(row)
    return going


class ScheduledPromotion:
    """The due scheduled rows of one relay's shards, made pending before it reads."""

    def __init__(
        self,
        spec: OutboxTableSpec,
        metrics: RelayMetrics,
        interval: float = RELOOK_SECONDS,
        limit: int = 1000,
    ) -> None:
        """``interval``: the least time between two looks (a message is made pending at most
        this long after it is due, by a busy relay); ``limit``: the most rows one look makes
        pending (the relay's batch size; more due are taken by the next look, at once)."""
        self.queries = Queries(spec)
        self.metrics = metrics
        self.interval = interval
        self.limit = limit
        dialect = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]
        self._due_sql = str(self.queries["due_scheduled"].compile(dialect=dialect))
        self._promote_sql = str(self.queries["promote_scheduled"].compile(dialect=dialect))
        self._lock_sql = str(self.queries["lock_due_scheduled"].compile(dialect=dialect))
        self._shards: tuple[int, ...] = ()
        #: Monotonic times: the next look allowed, and when the next scheduled row is due.
        self._next_look = float("-inf")
        self._next_due: float | None = None
        #: A look was skipped since the last one made.
        self._skipped = False

    def promote(
        self,
        shards: Collection[int],
        session: psycopg.Connection,
        owner_key: int | None,
        now: float | None = None,
    ) -> int:
        """Make the due scheduled rows of ``shards`` pending, on ``session`` (autocommit, the
        relay's reading session; ``owner_key`` as for the read: nothing is touched once the
        owner session is gone). Returns how many; 0 when the look is not due yet."""
        now = time.monotonic() if now is None else now
        owned = tuple(sorted(shards))
        due_now = self._next_due is not None and now >= self._next_due
        if owned == self._shards and now < self._next_look and not due_now:
            self._skipped = True
            return 0
        self._shards, self._skipped, self._next_look = owned, False, now + self.interval
        self._next_due = None
        if not owned:
            return 0
        rows = session.execute(
            self._due_sql,
            {
                "shards": list(owned),
                "limit": self.limit,
                "owner_key": owner_key,
                **self.queries.spec.owner_session_keys,
            },
        ).fetchall()
        due = sorted(
            (DueRow(row[0], row[1], row[2], row[3], row[4]) for row in rows if row[0] is not None),
            key=lambda row: (row.deliver_at, row.seq),
        )
        waits = [float(row[5]) for row in rows if row[0] is None]
        if len(due) >= self.limit:
            self._next_due = now  # more are due: the next look takes them
        elif waits:
            self._next_due = now + max(0.0, waits[0])
        if not due:
            return 0
        # One statement per row, in one transaction sent at once: each takes its new seq in
        # this order (the order of an UPDATE's rows is the plan's, not the query's).
        with session.transaction(), session.cursor() as cursor:
            ids = "{" + ",".join(row.id.hex for row in due) + "}"
            # Rows no other transaction holds: those still scheduled may go; those cancelled
            # meanwhile go nowhere, and hold back nothing.
            locked = cursor.execute(self._lock_sql, {"ids": ids}).fetchall()
            free = {found for found, state in locked if state == "scheduled"}
            gone = {found for found, state in locked if state != "scheduled"}
            going = promotable([row for row in due if row.id not in gone], free)
            if going:
                cursor.executemany(self._promote_sql, [{"id": row.id} for row in going])
            promoted = max(0, cursor.rowcount) if going else 0
        if len(going) + len(gone) < len(due):
            # Skipped: held by a transaction that may roll back. Look again soon.
            relook = now + self.interval
            self._next_due = relook if self._next_due is None else min(self._next_due, relook)
        self.metrics.promoted.inc(promoted)
        return promoted

    def look_waiting(self, now: float | None = None) -> bool:
        """Whether a look is due now (one skipped since the last, or the next due time
        come): a relay with no read to make makes it before it sleeps."""
        now = time.monotonic() if now is None else now
        due_now = self._next_due is not None and now >= self._next_due
        return (self._skipped and now >= self._next_look) or due_now

    def sleep_bound(self, timeout: float, now: float | None = None) -> float:
        """``timeout``, cut to the next due time of the shards last looked at, and to the next
        look allowed when one was skipped since the last look made."""
        now = time.monotonic() if now is None else now
        bounds = [timeout]
        if self._next_due is not None:
            bounds.append(self._next_due - now)
        if self._skipped:
            bounds.append(self._next_look - now)
        return max(0.0, min(bounds))

    def refresh_gauges(self, session: psycopg.Connection) -> None:
        """Count the table's overdue and scheduled messages into the relay's gauges, on
        ``session`` (the gauges' own: a count of a million takes a tenth of a second)."""
        dialect = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]
        overdue = str(self.queries["count_overdue"].compile(dialect=dialect))
        row = session.execute(overdue, {"shard_count": SHARD_COUNT}).fetchone()
        self.metrics.scheduled_overdue.set(row[0] if row else 0)
        counted = session.execute(str(self.queries["count_scheduled"])).fetchone()
        self.metrics.scheduled.set(counted[0] if counted else 0)
