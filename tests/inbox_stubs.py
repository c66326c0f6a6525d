"""Stand-ins for Kafka and the database, to run :class:`~outbox.inbox.InboxRunner` and its
real :class:`~outbox.inbox.apply.Applier` without servers.

:class:`StubConsumer` keeps the records of each partition in memory and does what the runner
asks of a ``confluent_kafka.Consumer`` (assignment callbacks, pause, resume, seek, commits
answered through ``on_commit``). :class:`MemoryDatabase` holds the inbox rows, the parked
rows and the handlers' effects; :class:`StubApplier` applies batches through the real
algorithm in transactions on it (savepoints are copies, a failed transaction leaves nothing).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import sqlalchemy as sa
from confluent_kafka import TopicPartition

from outbox.inbox import Inbox, InboxRunner
from outbox.inbox.apply import Applier, DatabaseUnavailable
from outbox.inbox.config import ConsumerConfig
from outbox.inbox.metrics import InboxMetrics
from outbox.inbox.schema import PARKED
from outbox.inbox.sessions import BatchApplier, run_at_once
from outbox.inbox.store import Claim

T = TypeVar("T")
TP = tuple[str, int]
NOWHERE = "postgresql+psycopg://app@127.0.0.1:1/shop"


# -- Kafka ------------------------------------------------------------------------------------


@dataclass
class StubRecord:
    """A ``confluent_kafka.Message`` as the runner reads it."""

    _topic: str
    _partition: int
    _offset: int
    _value: bytes
    _headers: list[tuple[str, bytes]]
    _key: bytes | None = b"k"

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers

    def error(self) -> None:
        return None


class StubConsumer:
    """One group member over in-memory partitions: every partition is assigned to it on the
    first ``consume``; :meth:`revoke` takes some away at the next one."""

    def __init__(self, settings: dict[str, Any], log: dict[TP, list[StubRecord]]) -> None:
        self.settings = settings
        self.log = log
        self.positions: dict[TP, int] = {}
        self.paused: set[TP] = set()
        self.committed: dict[TP, int] = {}
        self.callbacks: dict[str, Callable[..., Any]] = {}
        self._due: list[Callable[[], None]] = []  # callbacks run inside the next consume
        self._lock = threading.Lock()
        self.closed = False

    def subscribe(self, topics: list[str], **callbacks: Callable[..., Any]) -> None:
        self.callbacks = callbacks
        mine = [tp for tp in self.log if tp[0] in topics]
        self._later(lambda: self._assign(mine))

    def revoke(self, partitions: list[TP]) -> None:
        """A rebalance takes ``partitions`` away (run inside the next ``consume``)."""
        self._later(lambda: self._revoke(partitions))

    def consume(self, num_messages: int, timeout: float) -> list[StubRecord]:
        with self._lock:
            due, self._due = self._due, []
        for callback in due:
            callback()
        batch: list[StubRecord] = []
        for tp, at in sorted(self.positions.items()):
            if tp in self.paused:
                continue
            taken = self.log[tp][at : at + num_messages - len(batch)]
            self.positions[tp] = at + len(taken)
            batch += taken
        if not batch:
            time.sleep(min(timeout, 0.01))
        return batch

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused |= {(p.topic, p.partition) for p in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused -= {(p.topic, p.partition) for p in partitions}

    def seek(self, partition: TopicPartition) -> None:
        self.positions[(partition.topic, partition.partition)] = partition.offset

    def commit(
        self, offsets: list[TopicPartition], asynchronous: bool = True
    ) -> list[TopicPartition] | None:
        for p in offsets:
            self.committed[(p.topic, p.partition)] = p.offset
        if asynchronous:
            self._later(lambda: self.settings["on_commit"](None, offsets))
            return None
        return offsets

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [
            TopicPartition(p.topic, p.partition, self.positions.get((p.topic, p.partition), -1))
            for p in partitions
        ]

    def get_watermark_offsets(self, partition: TopicPartition, cached: bool = False) -> Any:
        return 0, len(self.log[(partition.topic, partition.partition)])

    def close(self) -> None:
        self.closed = True

    def _later(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._due.append(callback)

    def _assign(self, partitions: list[TP]) -> None:
        for tp in partitions:
            self.positions[tp] = self.committed.get(tp, 0)
        self.callbacks["on_assign"](self, [TopicPartition(t, p) for t, p in partitions])

    def _revoke(self, partitions: list[TP]) -> None:
        self.callbacks["on_revoke"](self, [TopicPartition(t, p) for t, p in partitions])
        for tp in partitions:
            self.positions.pop(tp, None)
            self.paused.discard(tp)


# -- the database -----------------------------------------------------------------------------


@dataclass
class Tables:
    """The inbox rows, the parked rows and the handlers' effects."""

    inbox: dict[str, Claim] = field(default_factory=dict)
    parked: list[dict[str, Any]] = field(default_factory=list)
    effects: list[Any] = field(default_factory=list)


class MemoryDatabase:
    """What committed; ``down`` makes every transaction fail as an outage does."""

    def __init__(self) -> None:
        self.tables = Tables()
        self.down = False
        self.transactions = 0


class MemoryTransaction:
    """One transaction on a :class:`MemoryDatabase`: handlers get it as their session and
    write ``session.effects.append(...)``."""

    def __init__(self, tables: Tables) -> None:
        self.tables = copy.deepcopy(tables)

    @property
    def session(self) -> MemoryTransaction:
        return self

    @property
    def effects(self) -> list[Any]:
        return self.tables.effects

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self, *args)

    async def call(self, handler: Callable[..., Any], argument: Any) -> None:
        handler(argument, self)

    def pending_writes(self) -> bool:
        return False

    async def flush(self) -> None:
        pass

    async def savepoint(self) -> Tables:
        return copy.deepcopy(self.tables)

    async def release(self, savepoint: Any) -> None:
        pass

    async def rollback(self, savepoint: Any) -> None:
        self.tables = savepoint


class MemoryStore:
    """:class:`~outbox.inbox.store.InboxStore`'s statements, on a :class:`MemoryTransaction`."""

    def problem(self, engine: Any) -> None:
        return None

    def claim_many(self, tx: MemoryTransaction, group: str, claims: list[Claim]) -> set[str]:
        new = set()
        for claim in claims:
            if claim.message_id not in tx.tables.inbox:
                tx.tables.inbox[claim.message_id] = claim
                new.add(claim.message_id)
        return new

    def claim_one(self, tx: MemoryTransaction, group: str, claim: Claim) -> bool:
        return bool(self.claim_many(tx, group, [claim]))

    def park(self, tx: MemoryTransaction, group: str, record: Any, message_id: Any,
             reason: str, error: str, attempts: int) -> int | None:  # fmt: skip
        place = (record.topic, record.partition, record.offset)
        if any(row["place"] == place for row in tx.tables.parked):
            return None
        parked_id = len(tx.tables.parked) + 1
        tx.tables.parked.append(
            {
                "id": parked_id,
                "place": place,
                "message_id": message_id,
                "reason": reason,
                "error": error,
                "attempts": attempts,
                "status": PARKED,
                "record": record,
            }
        )
        return parked_id

    def take_requeued(self, tx: MemoryTransaction, group: str, limit: int) -> list[Any]:
        return []  # the loop's tests do not requeue

    def purge_processed(self, engine: Any, older_than: Any) -> int:
        return 0


class StubApplier(BatchApplier):
    """The real :class:`~outbox.inbox.apply.Applier`, on a :class:`MemoryDatabase`."""

    def __init__(self, database: MemoryDatabase, inbox: Inbox, metrics: InboxMetrics,
                 max_attempts: int) -> None:  # fmt: skip
        self.database = database
        self._applier = Applier(self._begin, inbox, MemoryStore(), metrics, max_attempts)  # type: ignore[arg-type]

    @asynccontextmanager
    async def _begin(self) -> AsyncIterator[Any]:
        if self.database.down:
            raise DatabaseUnavailable("connection refused")
        tx = MemoryTransaction(self.database.tables)
        yield tx
        self.database.tables = tx.tables  # committed
        self.database.transactions += 1

    def _drive(self, step: Coroutine[Any, Any, T]) -> T:
        return run_at_once(step)


def stub_runner(
    inbox: Inbox, log: dict[TP, list[StubRecord]], database: MemoryDatabase, **config: Any
) -> tuple[InboxRunner, list[StubConsumer]]:
    """A runner on stubs; the list gets its consumer once it subscribes."""
    options: dict[str, Any] = {
        "database_url": NOWHERE,
        "kafka": {"bootstrap.servers": "stub:9092"},
        "max_wait": 0.01,
        "backoff_base": 0.01,
        "backoff_max": 0.05,
        "requeue_interval": 3600.0,
    }
    options.update(config)
    settings = ConsumerConfig(**options)
    metrics = InboxMetrics()
    consumers: list[StubConsumer] = []

    def consumer_factory(kafka: dict[str, Any]) -> Any:
        consumers.append(StubConsumer(kafka, log))
        return consumers[-1]

    runner = InboxRunner(
        inbox,
        settings,
        metrics=metrics,
        store=MemoryStore(),  # type: ignore[arg-type]
        engine=sa.create_engine(NOWHERE),
        applier=StubApplier(database, inbox, metrics, settings.max_attempts),
        consumer_factory=consumer_factory,
    )
    return runner, consumers
