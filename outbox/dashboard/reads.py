"""What each page of the dashboard shows, read with the functions the commands use.

The overview is ``outbox status`` (:func:`outbox.status.read_status`) with three more
columns: dead messages per topic (the rows ``outbox dead list --by-reason`` groups), messages
sent in the last hour, and the consumers' lag. The first two read more than the partial
indexes (every dead row, the last hour's ids), and the lag asks Kafka: they are read again
at most every ``scan_interval`` seconds, however many browsers refresh the page.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar

import sqlalchemy as sa

from outbox.failed_rows import dead_rows
from outbox.fingerprints import ReasonGroup
from outbox.inbox.parked import parked_groups
from outbox.inbox.schema import PARKED, InboxTableSpec
from outbox.inbox.store import InboxStore
from outbox.operator import dead_groups, find_message
from outbox.prepared.store import UNRESOLVED, PreparedStore
from outbox.queries import Queries
from outbox.retention import uuid7_floor
from outbox.status import OutboxStatus, read_parked, read_status

T = TypeVar("T")

#: "Sent in the last hour".
RECENT = timedelta(hours=1)
#: Messages listed under each cause; the cause's own page lists up to CAUSE_LIMIT.
PER_GROUP = 20
CAUSE_LIMIT = 500
#: Prepared messages listed.
PREPARED_LIMIT = 200


class Every(Generic[T]):
    """``compute()``'s value, computed again once it is ``seconds`` old (one caller computes
    while the others wait for it)."""

    def __init__(self, seconds: float, compute: Callable[[], T]) -> None:
        self.seconds = seconds
        self.compute = compute
        self._lock = threading.Lock()
        self._value: tuple[float, T] | None = None

    def get(self) -> T:
        with self._lock:
            if self._value is None or time.monotonic() - self._value[0] >= self.seconds:
                self._value = (time.monotonic(), self.compute())
            return self._value[1]


@dataclass
class TopicRow:
    """One topic's line of the overview."""

    topic: str
    pending: int = 0
    backing_off: int = 0
    oldest_pending_seconds: float | None = None
    sent_last_hour: int = 0
    dead: int = 0
    prepared: int = 0
    scheduled: int = 0
    overdue: int = 0
    next_due_seconds: float | None = None


@dataclass
class ConsumerRow:
    """One consumer group of the inbox."""

    group: str
    parked: int = 0
    retrying: int = 0
    oldest_parked_seconds: float | None = None
    #: None: not known (no Kafka settings given, or Kafka did not answer: ``lag_error``).
    lag: int | None = None
    lag_error: str | None = None


@dataclass
class Scans:
    """The overview's costlier counts, taken at ``taken_at``."""

    taken_at: datetime
    dead: dict[str, int]
    #: Dead prepared messages check-back gave up on: an operator decides them.
    unresolved: int
    sent: dict[str, int]
    lag: dict[str, tuple[int | None, str | None]] = field(default_factory=dict)


@dataclass
class Overview:
    status: OutboxStatus
    scans: Scans
    topics: list[TopicRow]
    consumers: list[ConsumerRow]
    #: None when the inbox tables are not in the inbox's database.
    inbox_table: str | None
    lag_known: bool


@dataclass
class DeadMessage:
    id: uuid.UUID
    topic: str
    key: bytes | None
    attempts: int
    error: str | None


@dataclass
class Cause(Generic[T]):
    """A cause of failure, with the first of its rows."""

    group: ReasonGroup[Any]
    rows: list[T]


@dataclass
class MessageView:
    """A message looked up by id: its row in the outbox (None: no such message), and
    where the inbox's groups applied or parked it."""

    id: uuid.UUID
    row: Any
    applied: list[Any]
    parked: list[Any]
    inbox_table: str | None


class Reads:
    """Every read of the dashboard, on the outbox's and the inbox's databases."""

    def __init__(
        self,
        outbox: sa.Engine,
        queries: Queries,
        inbox: sa.Engine,
        inbox_spec: InboxTableSpec,
        *,
        kafka: dict[str, Any] | None = None,
        scan_interval: float = 60.0,
    ) -> None:
        self.outbox = outbox
        self.queries = queries
        self.inbox = inbox
        self.inbox_store = InboxStore(inbox_spec)
        self.prepared_store = PreparedStore(queries.spec)
        self.kafka = kafka
        self.scan_interval = scan_interval
        self._scans = Every(scan_interval, self._scan)

    # -- the overview -------------------------------------------------------------------------

    def overview(self) -> Overview:
        spec = self.inbox_store.spec
        status = read_status(self.outbox, self.queries, inbox=None)
        scans = self._scans.get()
        topics = {
            t.topic: TopicRow(
                t.topic,
                pending=t.pending,
                backing_off=t.backing_off,
                oldest_pending_seconds=t.oldest_pending_seconds,
                prepared=t.prepared,
                scheduled=t.scheduled,
                overdue=t.overdue,
                next_due_seconds=t.next_due_seconds,
            )
            for t in status.topics
        }
        for name, dead in scans.dead.items():
            topics.setdefault(name, TopicRow(name)).dead = dead
        for name, sent in scans.sent.items():
            topics.setdefault(name, TopicRow(name)).sent_last_hour = sent
        inbox_table: str | None = None
        consumers: dict[str, ConsumerRow] = {}
        with self.inbox.connect() as conn:
            if self.inbox_store.check(conn) is None:
                inbox_table = f"{spec.schema}.{spec.parked_name}"
                for group in self.inbox_store.groups(conn):
                    consumers[group] = ConsumerRow(group)
                for parked in read_parked(conn, (spec.schema, spec.table))[1]:
                    group = parked.consumer_group
                    consumer = consumers.setdefault(group, ConsumerRow(group))
                    if parked.status == PARKED:
                        consumer.parked += parked.count
                        consumer.oldest_parked_seconds = max(
                            consumer.oldest_parked_seconds or 0.0, parked.oldest_seconds
                        )
                    else:
                        consumer.retrying += parked.count
        for group, (lag, error) in scans.lag.items():
            if group in consumers:
                consumers[group].lag, consumers[group].lag_error = lag, error
        return Overview(
            status=status,
            scans=scans,
            topics=sorted(topics.values(), key=lambda t: t.topic),
            consumers=sorted(consumers.values(), key=lambda c: c.group),
            inbox_table=inbox_table,
            lag_known=self.kafka is not None,
        )

    def _scan(self) -> Scans:
        now = datetime.now(UTC)
        since = now - RECENT
        with self.outbox.connect() as conn:
            dead: dict[str, int] = {}
            unresolved = 0
            for row in dead_rows(conn, self.queries, None):
                dead[row.topic] = dead.get(row.topic, 0) + 1
                unresolved += row.kind == UNRESOLVED
            params = {"since_id": uuid7_floor(since), "since": since}
            recent = conn.execute(self.queries["sent_recently"], params)
            sent = {row.topic: int(row.sent) for row in recent}
        lag: dict[str, tuple[int | None, str | None]] = {}
        if self.kafka is not None:
            lag = self._lag()
        return Scans(now, dead, unresolved, sent, lag)

    def _lag(self) -> dict[str, tuple[int | None, str | None]]:
        from outbox.inbox.lag import read_lag

        with self.inbox.connect() as conn:
            if self.inbox_store.check(conn) is not None:
                return {}
            groups = self.inbox_store.groups(conn)
        assert self.kafka is not None
        return {g.group: (g.total, g.error) for g in read_lag(self.kafka, groups)}

    # -- dead messages ------------------------------------------------------------------------

    def dead_causes(self, topic: str | None, reason: str | None) -> list[Cause[DeadMessage]]:
        """The causes of the dead messages (of ``topic``), or only the cause ``reason``
        names, each with its first messages."""
        from outbox.fingerprints import pick_group

        with self.outbox.connect() as conn:
            groups = dead_groups(conn, self.queries, topic)
            limit = PER_GROUP
            if reason is not None:
                picked = pick_group(groups, reason)
                groups, limit = ([picked] if picked else []), CAUSE_LIMIT
            shown = [mid for g in groups for mid in g.ids[:limit]]
            found = {
                row.id: DeadMessage(row.id, row.topic, row.key, row.attempts, row.last_error)
                for row in conn.execute(self.queries["dead_details"], {"ids": shown})
            }
        return [Cause(g, [found[mid] for mid in g.ids[:limit] if mid in found]) for g in groups]

    # -- parked inbox messages ----------------------------------------------------------------

    def parked_causes(
        self, group: str | None, topic: str | None, reason: str | None
    ) -> list[Cause[Any]] | None:
        """As :meth:`dead_causes`, of the parked messages waiting for an operator; None when
        the inbox tables are not in the inbox's database."""
        from outbox.fingerprints import pick_group

        with self.inbox.connect() as conn:
            if self.inbox_store.check(conn) is not None:
                return None
            groups = parked_groups(conn, self.inbox_store, group, topic)
            limit = PER_GROUP
            if reason is not None:
                picked = pick_group(groups, reason)
                groups, limit = ([picked] if picked else []), CAUSE_LIMIT
            shown = [pid for g in groups for pid in g.ids[:limit]]
            rows = {row.id: row for row in self.inbox_store.parked_by_ids(conn, shown)}
        return [Cause(g, [rows[pid] for pid in g.ids[:limit] if pid in rows]) for g in groups]

    # -- prepared messages --------------------------------------------------------------------

    def unresolved(self, topic: str | None, check_group: str | None) -> list[sa.RowMapping]:
        """Prepared messages waiting for a verdict, oldest first (``outbox prepared list``)."""
        with self.outbox.connect() as conn:
            return self.prepared_store.unresolved(
                conn, topic=topic, check_group=check_group, limit=PREPARED_LIMIT
            )

    # -- one message --------------------------------------------------------------------------

    def message(self, message_id: uuid.UUID) -> MessageView:
        with self.outbox.connect() as conn:
            row = find_message(conn, self.queries, message_id)
        applied: list[Any] = []
        parked: list[Any] = []
        inbox_table = None
        with self.inbox.connect() as conn:
            if self.inbox_store.check(conn) is None:
                inbox_table = self.inbox_store.spec.qualified_name
                groups = self.inbox_store.groups(conn)
                applied = self.inbox_store.applied(conn, str(message_id), groups)
                parked = self.inbox_store.parked_of_message(conn, str(message_id))
        return MessageView(message_id, row, applied, parked, inbox_table)
