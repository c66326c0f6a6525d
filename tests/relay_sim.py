"""A simulated world for the model-based test of the relay: clock, table, locks and brokers.

The relays in it are real: :class:`outbox.relay.daemon.Relay` with its real core, driver and
senders (at-least-once and exactly-once, with their producers' bookkeeping, deadlines,
fencing, limit learning and progress records), stepped one round at a time (``Relay.step``).
Only what lies outside the relay's process is simulated, deterministically from a seed:

- **the database** (:class:`SimTable`): outbox rows with their seq, status, attempts, backoff,
  immediate-send leases and scheduled times; writers' transactions (one may stay open across
  steps: its rows commit later with lower seqs); other transactions' row locks; the reads
  (what ``read_batch`` returns: a key held back from a row backing off or leased, each shard's
  window), the promotion of due scheduled rows (through the relay's own ``promotable``), the
  marks (SKIP LOCKED: a locked row is held back), keep-nothing deletes;
- **the sessions and advisory locks** (:class:`SimLocks`): a relay's owner session holds its
  shards; killing it drops them at once, and the relay learns at its next statement;
- **the brokers** (:class:`SimBroker`): topics with a ``max.message.bytes``, partitions, the
  requests a producer forms (records of a partition up to its ``batch.size``), whole-request
  refusals, records too large even alone, outages, a partition whose leader stalls, a relay
  whose own path is cut, transactions with epochs and fencing, the progress topic; a fake
  ``confluent_kafka.Producer`` and ``Consumer`` over it.

Everything that happens is recorded, and :meth:`World.check` and :meth:`World.finish` hold it
to the relay's guarantees (see tests/unit/test_relay_model.py).
"""

from __future__ import annotations

import heapq
import itertools
import random
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException

from outbox.records import OutboxRecord
from outbox.relay import promotion
from outbox.relay.commands import BatchEnded, Read, Rebalance, Rebalanced, Recorded, Recording
from outbox.relay.config import RelayConfig
from outbox.relay.daemon import Parts, Relay
from outbox.relay.leases import free_order, plan_shares
from outbox.relay.policy import RetryPolicy
from outbox.relay.promotion import DueRow
from outbox.relay.sender import AtLeastOnceSender, TopicLimits
from outbox.relay.transactions import ExactlyOnceSender
from outbox.rows import PendingRow
from outbox.schema import SHARD_COUNT, OutboxTableSpec, shard_of

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
PROGRESS = "progress"
#: A record batch's own bytes, and a record's, beside its key and value (roughly Kafka's).
BATCH_HEADER = 61
RECORD_OVERHEAD = 20
DEFAULT_LIMIT = 1_048_588
#: How long a message committed to a sleeping relay may wait before it is sent: its wake-up and
#: a read (the relay's turns come within a few milliseconds of what wakes them).
WAKE_BOUND = 0.04


class Dead(psycopg.OperationalError):
    """A statement on a session the world killed."""


# -- the database ----------------------------------------------------------------------------


@dataclass
class SimRow:
    id: uuid.UUID
    shard: int
    topic: str
    key: bytes | None
    value: bytes
    seq: int
    status: str  # uncommitted, pending, scheduled, sent, dead, cancelled
    created: float
    attempts: int = 0
    next_attempt_at: float | None = None
    lease_until: float | None = None
    deliver_at: float | None = None
    generation: int = 0
    error_kind: str | None = None
    undecodable: bool = False
    #: Outcomes the world caused for it: a partition of its stalled while it was in flight.
    stalled: bool = False


class SimTable:
    """The outbox table, and the transactions of others on it."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.rows: dict[uuid.UUID, SimRow] = {}
        self._seq = itertools.count(1)
        #: Rows other transactions hold locked, until when (the world's clock).
        self.locked: dict[uuid.UUID, float] = {}
        #: Rows made pending, in the order they became visible (for the order check).
        self.visible_order: list[uuid.UUID] = []
        self.delete_on_send = False

    def insert(
        self, topic: str, key: bytes | None, size: int, *, deliver_at: float | None = None
    ) -> SimRow:
        row_id = uuid.UUID(int=self.world.rng.getrandbits(128))
        shard = shard_of(key, row_id)
        row = SimRow(
            row_id,
            shard,
            topic,
            key,
            row_id.bytes + bytes(max(0, size - 16)),
            next(self._seq),
            "uncommitted",
            self.world.now,
            deliver_at=deliver_at,
        )
        self.rows[row_id] = row
        self.world.keys[row_id] = (topic, key)
        return row

    def commit(self, rows: Sequence[SimRow]) -> None:
        self.world.commit_seen(rows)
        for row in rows:
            if row.deliver_at is not None:
                row.status = "scheduled"
            else:
                row.status = "pending"
                self.visible_order.append(row.id)
                self.world.seq_of[row.id] = row.seq
        self.world.notify()

    def now_locked(self, row_id: uuid.UUID) -> bool:
        until = self.locked.get(row_id)
        return until is not None and until > self.world.now

    # -- what the relay's statements do ------------------------------------------------------

    def read(self, shards: Sequence[int], size: int, per_shard: int) -> list[PendingRow]:
        now = self.world.now
        found: list[SimRow] = []
        for shard in shards:
            rows = sorted(
                (r for r in self.rows.values() if r.shard == shard and r.status == "pending"),
                key=lambda r: r.seq,
            )
            held: set[tuple[str, bytes]] = set()
            taken = 0
            for row in rows:
                key = None if row.key is None else (row.topic, row.key)
                backing_off = row.next_attempt_at is not None and row.next_attempt_at > now
                leased = row.lease_until is not None and row.lease_until > now
                if backing_off or leased:
                    if key is not None:
                        held.add(key)
                    continue
                if key is not None and key in held:
                    continue
                found.append(row)
                taken += 1
                if taken >= per_shard:
                    break
        found.sort(key=lambda r: r.seq)
        return [self._pending_row(row) for row in found[:size]]

    def _pending_row(self, row: SimRow) -> PendingRow:
        created = EPOCH + timedelta(seconds=row.created)
        if row.undecodable:
            return PendingRow(row.id, row.shard, row.attempts, created, None, "undecodable: x")
        record = OutboxRecord(
            row.id, row.seq, row.shard, row.topic, row.key, row.value, [], row.generation
        )
        return PendingRow(row.id, row.shard, row.attempts, created, record)

    def promote(self, shards: Sequence[int]) -> int:
        now = self.world.now
        due = sorted(
            (
                r
                for r in self.rows.values()
                if r.status == "scheduled" and r.shard in shards and (r.deliver_at or 0) <= now
            ),
            key=lambda r: (r.deliver_at, r.seq),
        )
        rows = [
            DueRow(r.id, EPOCH + timedelta(seconds=r.deliver_at or 0), r.seq, r.topic, r.key)
            for r in due
        ]
        free = {r.id for r in due if not self.now_locked(r.id)}
        going = promotion.promotable(rows, free)
        for picked in going:
            row = self.rows[picked.id]
            row.status = "pending"
            row.seq = next(self._seq)
            row.created = now
            self.visible_order.append(row.id)
            self.world.seq_of[row.id] = row.seq
        return len(going)

    def next_due(self, shards: Sequence[int]) -> float | None:
        times = [
            r.deliver_at
            for r in self.rows.values()
            if r.status == "scheduled" and r.shard in shards and r.deliver_at is not None
        ]
        return min(times, default=None)

    def record(self, recording: Recording) -> frozenset[uuid.UUID]:
        """The recorder's statements: what it could not record (rows locked by others)."""
        held: set[uuid.UUID] = set()
        now = self.world.now
        for ack in recording.acks:
            row = self.rows.get(ack.id)
            if row is None:
                continue
            if self.now_locked(ack.id):
                held.add(ack.id)
                continue
            if row.status != "pending" or row.generation != ack.generation:
                continue
            if self.delete_on_send:
                del self.rows[ack.id]
                self.world.deleted_sent.add(ack.id)
            else:
                row.status, row.attempts = "sent", row.attempts + 1
                row.lease_until = None
        for failure in recording.failures:
            row = self.rows.get(failure.id)
            if row is None:
                continue
            if self.now_locked(failure.id):
                held.add(failure.id)
                continue
            if row.status != "pending":
                continue
            row.attempts += 1
            row.error_kind = failure.kind
            row.lease_until = None
            if failure.delay is None:
                row.status = "dead"
                self.world.dead_kinds[row.id] = failure.kind
            else:
                row.next_attempt_at = now + failure.delay
        return frozenset(held)


# -- sessions and advisory locks -------------------------------------------------------------


class SimLocks:
    """Who holds which shard, who is a member and who serves; each session by a number."""

    def __init__(self) -> None:
        self.shards: dict[int, int] = {}
        self.members: set[int] = set()
        self.serving: set[int] = set()
        self.alive: set[int] = set()
        self._sessions = itertools.count(1)

    def open(self) -> int:
        session = next(self._sessions)
        self.alive.add(session)
        return session

    def kill(self, session: int) -> None:
        self.alive.discard(session)
        self.members.discard(session)
        self.serving.discard(session)
        for shard in [s for s, holder in self.shards.items() if holder == session]:
            del self.shards[shard]


# -- the brokers ----------------------------------------------------------------------------


@dataclass
class Entry:
    """A record in a partition's log."""

    record_id: uuid.UUID | None
    key: bytes | None
    value: bytes
    producer: str
    #: committed, aborted, or open (exactly-once, its transaction not ended yet).
    state: str = "committed"
    txn: tuple[str, int] | None = None


@dataclass
class Request:
    """Records of one partition a producer sent in one request."""

    topic: str
    partition: int
    messages: list[FakeMessage]
    answer_at: float
    refused: bool = False
    lands: bool = True


class SimBroker:
    def __init__(self, world: World, partitions: int) -> None:
        self.world = world
        self.partitions = partitions
        self.limits: dict[str, int] = {}
        #: Topics whose limit the brokers do not say (no DescribeConfigs right).
        self.unsaid: set[str] = set()
        self.logs: dict[tuple[str, int], list[Entry]] = defaultdict(list)
        self.epochs: dict[str, int] = {}
        self.down = False
        self.stalled: set[tuple[str, int]] = set()
        #: Relays whose own path to the brokers is cut.
        self.cut: set[str] = set()

    def reachable(self, relay: str) -> bool:
        return not self.down and relay not in self.cut

    def partition_of(self, topic: str, key: bytes | None) -> int:
        if topic == PROGRESS:
            raise AssertionError("progress records name their partition")
        return zlib.crc32(key or b"") % self.partitions

    def append(self, entry: Entry, topic: str, partition: int) -> int:
        log = self.logs[(topic, partition)]
        log.append(entry)
        self.world.appended(topic, partition, len(log) - 1, entry)
        return len(log) - 1

    def fence(self, transactional_id: str) -> int:
        """A new producer of ``transactional_id``: its epoch, the last one's open
        transaction aborted."""
        epoch = self.epochs.get(transactional_id, 0) + 1
        self.epochs[transactional_id] = epoch
        for log in self.logs.values():
            for entry in log:
                if (
                    entry.state == "open"
                    and entry.txn is not None
                    and entry.txn[0] == transactional_id
                ):
                    entry.state = "aborted"
        return epoch

    def describe(self, topic: str) -> int | None:
        if topic in self.unsaid or not self.reachable("admin"):
            return None
        return self.limits.get(topic, DEFAULT_LIMIT)


class FakeMessage:
    """What a delivery report or a consumer's poll hands over."""

    def __init__(
        self,
        topic: str,
        partition: int | None,
        offset: int | None,
        value: bytes | None,
        key: bytes | None = None,
        error: KafkaError | None = None,
    ) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset
        self._value, self._key, self._error = value, key, error
        self.callback: Callable[[KafkaError | None, FakeMessage], None] | None = None
        self.size = len(value or b"") + len(key or b"") + RECORD_OVERHEAD

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int | None:
        return self._partition

    def offset(self) -> int | None:
        return self._offset

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> bytes | None:
        return self._key

    def error(self) -> KafkaError | None:
        return self._error


class FakeProducer:
    """``confluent_kafka.Producer``, as far as the relay's senders use it, over the world's
    brokers: idempotent (at-least-once) or transactional (exactly-once)."""

    def __init__(self, config: dict[str, Any], world: World, relay: str) -> None:
        self.world, self.relay = world, relay
        self.batch_size = int(config.get("batch.size", 1_000_000))
        self.gapless = bool(config.get("enable.gapless.guarantee"))
        self.transactional_id: str | None = config.get("transactional.id")
        self.epoch = 0
        self.queued: list[FakeMessage] = []
        self.requests: list[Request] = []
        self.reports: list[tuple[FakeMessage, KafkaError | None]] = []
        self.fatal: KafkaError | None = None
        self._raised_fatal = False
        self.in_transaction = False
        self.txn_number = 0
        self.abortable: KafkaError | None = None
        self.closed = False
        world.producers.append(self)

    # -- producing ---------------------------------------------------------------------------

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        headers: Any = None,
        on_delivery: Callable[..., None] | None = None,
        partition: int | None = None,
    ) -> None:
        if self.fatal is not None:
            raise KafkaException(KafkaError(KafkaError._FATAL, "Local: Fatal error"))
        if self.transactional_id is not None and not self.in_transaction:
            raise KafkaException(KafkaError(KafkaError._STATE, "not in a transaction"))
        size = len(value or b"") + len(key or b"")
        if size > 1_000_000:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too large"))
        if partition is None:
            partition = self.world.broker.partition_of(topic, key)
        message = FakeMessage(topic, partition, None, value, key)
        message.callback = on_delivery
        if topic not in self.world.topics and topic != PROGRESS:
            self.reports.append((message, KafkaError(KafkaError._UNKNOWN_TOPIC, "unknown topic")))
            return
        self.queued.append(message)

    def poll(self, timeout: float = 0) -> int:
        self._pump()
        return self._serve()

    def flush(self, timeout: float = 0) -> int:
        self._pump()
        if self.transactional_id is not None:
            # A transactional producer's thread blocks in flush until Kafka answered: the
            # world's time goes on meanwhile (up to ``timeout`` when Kafka does not answer).
            self._wait_for_answers(timeout if timeout and timeout > 0 else 1.0)
        self._serve()
        return len(self.queued) + sum(len(r.messages) for r in self.requests)

    def _wait_for_answers(self, timeout: float) -> bool:
        """Let the world's time pass until every request was answered (True), or for
        ``timeout`` when some cannot be (the brokers out of reach, a partition stalled)."""
        broker = self.world.broker
        while self.requests:
            blocked = not broker.reachable(self.relay) or any(
                (r.topic, r.partition) in broker.stalled for r in self.requests
            )
            if blocked:
                self.world.advance(timeout)
                self._pump()
                return not self.requests
            self.world.advance(max(0.0, min(r.answer_at for r in self.requests) - self.world.now))
            self._pump()
        return True

    def purge(self, in_queue: bool = True, in_flight: bool = True) -> None:
        purged = []
        if in_queue:
            purged.extend((m, KafkaError(KafkaError._PURGE_QUEUE, "purged")) for m in self.queued)
            self.queued = []
        if in_flight:
            stopped: set[tuple[str, int]] = set()
            for request in self.requests:
                # Bytes already on the wire may still be written: of each partition, the
                # first few requests (the broker takes them in their sequence only).
                where = (request.topic, request.partition)
                if where in stopped or request.refused or self.world.rng.random() >= 0.3:
                    stopped.add(where)
                    continue
                self._land(request, reported=False)
                purged.extend(
                    (m, KafkaError(KafkaError._PURGE_INFLIGHT, "purged")) for m in request.messages
                )
            self.requests = []
        self.reports.extend(purged)

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        if not self.world.broker.reachable(self.relay):
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "all brokers down"))
        return object()

    # -- transactions ----------------------------------------------------------------------

    def init_transactions(self, timeout: float = -1) -> None:
        assert self.transactional_id is not None
        if not self.world.broker.reachable(self.relay):
            self.world.advance(min(timeout, 10.0))
            raise KafkaException(
                KafkaError(KafkaError._TIMED_OUT, "init timed out", retriable=True)
            )
        self.epoch = self.world.broker.fence(self.transactional_id)

    def begin_transaction(self) -> None:
        self._check_fenced()
        self.in_transaction = True
        self.txn_number += 1
        self.abortable = None

    def commit_transaction(self, timeout: float = -1) -> None:
        self._check_fenced()
        self._pump()
        call = timeout if timeout and timeout > 0 else 10.0
        if not self.world.broker.reachable(self.relay) or not self._wait_for_answers(call):
            if self.world.broker.reachable(self.relay):
                pass  # waited for a stalled partition
            else:
                self.world.advance(call)
            raise KafkaException(
                KafkaError(KafkaError._TIMED_OUT, "commit timed out", retriable=True)
            )
        self._serve()
        if self.abortable is not None:
            raise KafkaException(
                KafkaError(self.abortable.code(), "must abort", txn_requires_abort=True)
            )
        for entry in self._open_entries():
            entry.state = "committed"
            self.world.committed(entry)
        self.in_transaction = False

    def abort_transaction(self, timeout: float = -1) -> None:
        self._check_fenced()
        if not self.world.broker.reachable(self.relay):
            self.world.advance(min(timeout, 10.0) if timeout > 0 else 10.0)
            raise KafkaException(
                KafkaError(KafkaError._TIMED_OUT, "abort timed out", retriable=True)
            )
        self.queued = []
        self.requests = []
        for entry in self._open_entries():
            entry.state = "aborted"
        self.in_transaction = False

    # -- internals -------------------------------------------------------------------------

    def _check_fenced(self) -> None:
        if self.transactional_id is None:
            return
        if self.world.broker.epochs.get(self.transactional_id, 0) != self.epoch:
            raise KafkaException(KafkaError(KafkaError._FENCED, "fenced", fatal=True))

    def _open_entries(self) -> list[Entry]:
        txn = (self.transactional_id or "", self.epoch * 1_000_000 + self.txn_number)
        return [
            e
            for log in self.world.broker.logs.values()
            for e in log
            if e.txn == txn and e.state == "open"
        ]

    def _waiting(self) -> bool:
        return bool(self.queued or self.requests)

    def answerable(self) -> bool:
        """Whether serving this producer now would get somewhere (a report, a request to
        answer): the relay's sender thread would be busy."""
        if self.reports or self.queued or (self.fatal is not None and not self._raised_fatal):
            return True
        broker = self.world.broker
        if not broker.reachable(self.relay):
            return False
        return any(
            r.answer_at <= self.world.now and (r.topic, r.partition) not in broker.stalled
            for r in self.requests
        )

    def _pump(self) -> None:
        """Form requests of what is queued (a partition's records, up to ``batch.size``) and
        answer those whose time came."""
        world, broker = self.world, self.world.broker
        if self.fatal is not None:
            return
        by_partition: dict[tuple[str, int], list[FakeMessage]] = defaultdict(list)
        for message in self.queued:
            by_partition[(message.topic(), message.partition() or 0)].append(message)
        self.queued = []
        for (topic, partition), messages in by_partition.items():
            chunk: list[FakeMessage] = []
            size = BATCH_HEADER
            for message in messages:
                if chunk and size + message.size > self.batch_size:
                    self._send(topic, partition, chunk, size)
                    chunk, size = [], BATCH_HEADER
                chunk.append(message)
                size += message.size
            if chunk:
                self._send(topic, partition, chunk, size)
        waiting: set[tuple[str, int]] = set()
        for request in list(self.requests):
            where = (request.topic, request.partition)
            if not broker.reachable(self.relay) or where in broker.stalled or where in waiting:
                if where in broker.stalled:
                    world.stalled_records(request.messages)
                waiting.add(where)
                # Not answered while the brokers are out of reach, nor after one that is not.
                continue
            if request.answer_at > world.now:
                waiting.add(where)
                continue
            self.requests.remove(request)
            if request.refused:
                error = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: Message size too large")
                self.reports.extend((m, error) for m in request.messages)
                if self.transactional_id is not None:
                    self.abortable = error
                elif self.gapless and self.fatal is None:
                    self.fatal = KafkaError(
                        KafkaError._GAPLESS_GUARANTEE, "gap-less guarantee", fatal=True
                    )
                    # Nothing after it lands; the rest fail or are never reported.
                    self.reports.extend(
                        (m, KafkaError(KafkaError._PURGE_QUEUE, "purged"))
                        for r in self.requests
                        for m in r.messages
                    )
                    self.requests = []
                    return
                continue
            self._land(request, reported=True)

    def _send(self, topic: str, partition: int, messages: list[FakeMessage], size: int) -> None:
        limit = self.world.broker.limits.get(topic, DEFAULT_LIMIT)
        delay = self.world.rng.choice((0.001, 0.002, 0.005, 0.02))
        # A partition's requests are answered in the order they were sent (the idempotent
        # producer's sequence numbers see to it).
        earlier = [
            r.answer_at for r in self.requests if (r.topic, r.partition) == (topic, partition)
        ]
        answer_at = max([self.world.now + delay, *earlier])
        self.requests.append(Request(topic, partition, messages, answer_at, refused=size > limit))

    def _land(self, request: Request, reported: bool) -> None:
        broker = self.world.broker
        txn = None
        state = "committed"
        if self.transactional_id is not None:
            txn = (self.transactional_id, self.epoch * 1_000_000 + self.txn_number)
            state = "open"
            if broker.epochs.get(self.transactional_id, 0) != self.epoch:
                return  # fenced: the broker refuses it
        for message in request.messages:
            record_id = self.world.id_of(message)
            entry = Entry(record_id, message.key(), message.value() or b"", self.relay, state, txn)
            offset = broker.append(entry, request.topic, request.partition)
            if reported:
                report = FakeMessage(request.topic, request.partition, offset, message.value())
                report.callback = message.callback
                self.reports.append((report, None))

    def _serve(self) -> int:
        if self.fatal is not None and not self._raised_fatal:
            self._raised_fatal = True
            raise KafkaException(self.fatal)
        served = 0
        while self.reports:
            message, error = self.reports.pop(0)
            if message.callback is not None:
                message.callback(error, message)
                served += 1
        return served


class FakeConsumer:
    """``confluent_kafka.Consumer`` for the take-overs' progress reads (read_committed)."""

    def __init__(self, config: dict[str, Any], world: World, relay: str) -> None:
        self.world, self.relay = world, relay
        self.assigned: dict[int, int] = {}

    def _check(self) -> None:
        if not self.world.broker.reachable(self.relay):
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "all brokers down"))

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        self._check()
        return object()

    def get_watermark_offsets(self, partition: Any, timeout: float = -1) -> tuple[int, int]:
        self._check()
        return 0, len(self.world.broker.logs[(PROGRESS, partition.partition)])

    def assign(self, partitions: Sequence[Any]) -> None:
        self.assigned = {tp.partition: tp.offset for tp in partitions}

    def unassign(self) -> None:
        self.assigned = {}

    def poll(self, timeout: float = -1) -> FakeMessage | None:
        self._check()
        for partition in sorted(self.assigned):
            log = self.world.broker.logs[(PROGRESS, partition)]
            position = self.assigned[partition]
            while position < len(log) and log[position].state != "committed":
                position += 1
            if position >= len(log):
                del self.assigned[partition]
                eof = KafkaError(KafkaError._PARTITION_EOF, "end")
                return FakeMessage(PROGRESS, partition, None, None, error=eof)
            self.assigned[partition] = position + 1
            return FakeMessage(PROGRESS, partition, position, log[position].value)
        return None

    def close(self) -> None:
        self.assigned = {}


# -- the relays' adapters ---------------------------------------------------------------------


class ManualExecutor:
    """An executor whose tasks the world runs, one at a time, when it chooses."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.tasks: list[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.tasks.append((lambda: fn(*args, **kwargs), (), future))
        return future

    def run_one(self) -> bool:
        if not self.tasks:
            return False
        task, _, future = self.tasks.pop(self.world.rng.randrange(len(self.tasks)))
        if not future.set_running_or_notify_cancel():
            return True
        try:
            future.set_result(task())
        except BaseException as error:
            future.set_exception(error)
        return True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.tasks = []


class InlineExecutor:
    """Runs each task at once, in the caller's thread (a take-over's fences, one by one)."""

    def __init__(self, workers: int = 1) -> None:
        pass

    def __enter__(self) -> InlineExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:
            future.set_exception(error)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        return None


class SimEvents:
    """The relay's event queue: answers wait here until the relay's next turn takes them."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.seen: Callable[[Any], None] = lambda item: None

    def put(self, item: Any) -> None:
        self.items.append(item)
        self.seen(item)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        return self.get_nowait()

    def get_nowait(self) -> Any:
        import queue

        if not self.items:
            raise queue.Empty
        return self.items.pop(0)


class SimStop:
    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        return self._set


class SimSession:
    """A relay's sessions (owner, reading, marking), alive while the world says."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.number = 0

    @property
    def alive(self) -> bool:
        return self.number in self.world.locks.alive

    def statement(self) -> None:
        if not self.alive:
            raise Dead("server closed the connection unexpectedly")


class SimLeases:
    def __init__(self, world: World, relay: SimRelay) -> None:
        self.world, self.relay = world, relay
        self.owned: set[int] = set()
        self.joined = False
        self.serving = False
        self.member_number = world.rng.randrange(2**31)
        self._held_off: dict[int, float] = {}

    @property
    def session(self) -> int:
        return self.relay.session.number

    @property
    def connected(self) -> bool:
        return self.relay.session.alive

    def connect(self) -> int:
        self.relay.session.number = self.world.locks.open()
        self.owned, self.joined, self.serving = set(), False, False
        return self.relay.session.number

    def forget(self) -> list[int]:
        lost = sorted(self.owned)
        if self.relay.session.alive:
            self.world.locks.kill(self.relay.session.number)
        self.owned, self.joined, self.serving = set(), False, False
        return lost

    def rebalance(self, command: Rebalance) -> Rebalanced:
        self.relay.session.statement()
        locks = self.world.locks
        if command.join and not self.joined:
            locks.members.add(self.session)
            self.joined = True
        others = len(locks.members - {self.session})
        serving = len(locks.serving - {self.session})
        if not self.joined:
            return Rebalanced(joined=False, other_members=others, others_serving=serving)
        shares = plan_shares(len(self.owned), command.releasable, others + 1, command.may_gain)
        self.release(shares.release)
        gained: list[int] = []
        if shares.gain:
            now = self.world.now
            free = [
                s
                for s in range(SHARD_COUNT)
                if s not in locks.shards and self._held_off.get(s, 0) <= now
            ]
            for shard in free_order(free, self.member_number)[: shares.gain]:
                locks.shards[shard] = self.session
                gained.append(shard)
            self.owned.update(gained)
        if gained or shares.release:
            self.world.note(
                f"{self.relay.name} gained {sorted(gained)} released {list(shares.release)}"
            )
        return Rebalanced(
            gained=tuple(sorted(gained)),
            lost=shares.release,
            surplus=shares.surplus,
            joined=True,
            other_members=others,
            others_serving=serving,
        )

    def release(self, shards: Sequence[int], hold_off: float = 0.0) -> None:
        self.relay.session.statement()
        if shards:
            self.world.note(f"{self.relay.name} releases {list(shards)} hold off {hold_off}")
        for shard in shards:
            if shard in self.owned:
                self.owned.discard(shard)
                if self.world.locks.shards.get(shard) == self.session:
                    del self.world.locks.shards[shard]
            if hold_off:
                self._held_off[shard] = self.world.now + hold_off

    def release_all(self) -> list[int]:
        released = sorted(self.owned)
        self.release(released)
        return released

    def set_serving(self, serving: bool) -> None:
        self.relay.session.statement()
        if serving and self.joined:
            self.world.locks.serving.add(self.session)
            self.serving = True
        elif not serving:
            self.world.locks.serving.discard(self.session)
            self.serving = False

    def step_aside(self) -> tuple[int, ...] | None:
        self.relay.session.statement()
        locks = self.world.locks
        if not self.joined or not (locks.serving - {self.session}):
            return None
        self.set_serving(False)
        released = self.release_all()
        locks.members.discard(self.session)
        self.joined = False
        self.world.stepped_aside.append((self.relay.name, self.world.now))
        return tuple(released)


class SimSource:
    def __init__(self, world: World, relay: SimRelay) -> None:
        self.world, self.relay = world, relay
        self.asleep = False
        self.notified = False
        self.sleeping_until: float | None = None

    @property
    def connected(self) -> bool:
        return self.relay.session.alive

    def connect(self, owner_key: int, name: str) -> None:
        self.relay.session.statement()

    def read(self, read: Read, owned: Sequence[int]) -> list[PendingRow]:
        self.relay.session.statement()
        self.world.table.promote(owned)
        rows = self.world.table.read(read.shards, read.size, read.per_shard)
        held = {
            s
            for s, holder in self.world.locks.shards.items()
            if holder == self.relay.session.number
        }
        rows = [row for row in rows if row.shard in held]  # as owner_alive / the lock protect
        self.world.reads += 1
        if len(rows) >= read.size:  # a backlog: what it left for the next read is no wake-up
            returned = {row.id for row in rows}
            for row_id in list(self.world.wake_watch):
                row = self.world.table.rows.get(row_id)
                if row is not None and row.shard in read.shards and row_id not in returned:
                    del self.world.wake_watch[row_id]
        return rows

    def busy(self) -> None:
        self.asleep = False
        self.sleeping_until = None

    def away(self) -> None:
        self.asleep = False

    def sleep(self, timeout: float) -> bool:
        self.relay.session.statement()
        due = self.world.table.next_due(sorted(self.relay.relay.core.owned))
        if due is not None:
            timeout = max(0.0, min(timeout, due - self.world.now + 0.001))
        if self.notified:
            self.notified = False
            return True
        if not self.asleep:
            self.asleep = True  # the last look before sleeping, as the wake lock's handshake
            return True
        self.sleeping_until = self.world.now + timeout
        return False

    def forget(self) -> None:
        self.asleep = False

    def close(self) -> None:
        self.asleep = False


class SimRecorder:
    def __init__(self, world: World, relay: SimRelay) -> None:
        self.world, self.relay = world, relay
        self.running: list[tuple[float, Recording, int]] = []

    @property
    def connected(self) -> bool:
        return self.relay.session.alive

    def connect(self, owner_key: int, name: str) -> None:
        self.relay.session.statement()

    def submit(self, recording: Recording) -> None:
        owned = self.relay.relay.core.owned
        if recording.batch is not None and any(
            recording.shard_of[ack.id] not in owned for ack in recording.acks
        ):
            # Its shards went idle, or were forgotten (stepping aside, the database lost):
            # another relay may own them and send (exactly-once: commit) the same rows.
            self.world.violation(
                f"{self.relay.name} records batch {recording.batch.number} of shards it no "
                f"longer owns ({sorted(recording.batch.shards - owned)})"
            )
        delay = self.world.rng.choice((0.001, 0.002, 0.005, 0.02))
        self.running.append((self.world.now + delay, recording, self.relay.session.number))

    def finish_one(self) -> bool:
        due = [r for r in self.running if r[0] <= self.world.now]
        if not due:
            return False
        item = due[self.world.rng.randrange(len(due))]
        self.running.remove(item)
        _, recording, session = item
        if session not in self.world.locks.alive:
            self.relay.events.put(Dead("the marking session was closed"))
            return True
        held = self.world.table.record(recording)
        self.world.note(
            f"{self.relay.name} recorded {len(recording.acks)} acks"
            f" {len(recording.failures)} failures, held {[str(h)[:8] for h in held]}"
        )
        self.relay.events.put(Recorded(recording, held))
        return True

    def abandon(self) -> None:
        self.running = []

    def forget(self) -> None:
        self.running = []

    def close(self) -> None:
        self.running = []


class SimLimits(TopicLimits):
    """Topic limits learned at once (the brokers answer in no time)."""

    def __init__(self, world: World) -> None:
        super().__init__({}, describe=world.broker.describe)

    def learned(self, topic: str) -> tuple[bool, int | None]:
        return True, self.of(topic)


@dataclass(eq=False)
class SimRelay:
    """One relay of the world: the real Relay on simulated parts."""

    world: World
    name: str
    relay: Relay = field(init=False)
    session: SimSession = field(init=False)
    events: SimEvents = field(default_factory=SimEvents)
    background: ManualExecutor = field(init=False)
    transactions: ManualExecutor = field(init=False)
    source: SimSource = field(init=False)
    leases: SimLeases = field(init=False)
    recorder: SimRecorder = field(init=False)
    stop: SimStop = field(default_factory=SimStop)
    wake_at: float = 0.0
    crashed: bool = False
    exited: bool = False
    #: Rows whose acknowledgement this relay's core was told, since its sessions were last
    #: lost (a second send of one of them, meanwhile, is a defect).
    acked: set[uuid.UUID] = field(default_factory=set)

    def __post_init__(self) -> None:
        world = self.world
        self.session = SimSession(world)
        self.background = ManualExecutor(world)
        self.transactions = ManualExecutor(world)
        self.source = SimSource(world, self)
        self.leases = SimLeases(world, self)
        self.recorder = SimRecorder(world, self)

        def parts(relay: Relay) -> Parts:
            return Parts(
                source=self.source,  # type: ignore[arg-type]
                leases=self.leases,  # type: ignore[arg-type]
                recorder=self.recorder,  # type: ignore[arg-type]
                make_sender=self._sender,
                background=self.background,
                events=self.events,
                clock=lambda: world.now,
                stop=self.stop,
                serving_thread=False,
            )

        self.relay = Relay(world.config, parts=parts)
        self.relay.owner = self.name
        self.events.seen = self._seen
        core = self.relay.core
        handle = core.handle

        def handled(event: Any, now: float) -> Any:
            # The core learns of the acknowledgements of a batch it still has in flight.
            if isinstance(event, BatchEnded) and event.batch.number in core.in_flight:
                world.acked(self, [ack.id for ack in event.result.acks])
            return handle(event, now)

        core.handle = handled  # type: ignore[method-assign]
        world.watch(self)

    def _seen(self, item: Any) -> None:
        """An answer queued for the loop: it turns soon, and acknowledgements are noted."""
        self.wake_at = min(self.wake_at, self.world.now)
        if isinstance(item, BatchEnded):
            r = item.result
            self.world.note(
                f"{self.name} batch {item.batch.number} ended: {len(r.acks)} acks, errors "
                f"{sorted({e.name() for e in r.errors.values()})}, {len(r.not_attempted)} not "
                f"attempted, lost {r.lost_shards}"
            )

    def _sender(self, relay: Relay) -> Any:
        sender = self._make_sender(relay)
        start = sender.start

        def checked(batch: Any) -> None:
            self.world.check_send(self, batch)
            start(batch)

        sender.start = checked
        return sender

    def _make_sender(self, relay: Relay) -> Any:
        world, config = self.world, self.world.config
        make_producer = lambda settings: FakeProducer(settings, world, self.name)  # noqa: E731
        if config.exactly_once:
            return ExactlyOnceSender(
                config.kafka,
                transactional_id_prefix="sim",
                progress_topic=PROGRESS,
                owner=self.name,
                delivery_timeout_ms=config.delivery_timeout_ms,
                give_up=relay._shutdown_overdue,
                clock=lambda: world.now,
                executor=self.transactions,
                producer_factory=make_producer,
                consumer_factory=lambda settings: FakeConsumer(settings, world, self.name),
                limits=SimLimits(world),
                close_inline=True,
                init_pool=InlineExecutor,
            )
        return AtLeastOnceSender(
            config.kafka,
            config.delivery_timeout_ms,
            relay._shutdown_overdue,
            clock=lambda: world.now,
            producer_factory=make_producer,
            limits=SimLimits(world),
        )


# -- the world -------------------------------------------------------------------------------


@dataclass
class Sent:
    """A copy of a message on its topic."""

    relay: str
    at: float
    partition: int
    offset: int


class World:
    """The world of one run (see the module)."""

    def __init__(self, seed: int, *, exactly_once: bool, delete_on_send: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        random.seed(seed)  # the retry policy's jitter draws from the module's generator
        self.now = 0.0
        self.exactly_once = exactly_once
        self.config = RelayConfig(
            database_url="postgresql+psycopg://sim@127.0.0.1/sim",
            # Requests of librdkafka's size, or small ones: a partition's records of one batch
            # then go in several requests, and one refused must stop those after it.
            kafka={"bootstrap.servers": "sim:9092", "batch.size": self.rng.choice((10**6, 3000))},
            spec=OutboxTableSpec(),
            mode="exactly-once" if exactly_once else "at-least-once",
            batch_size=self.rng.choice((3, 8, 20)),
            poll_interval=30.0,  # wake-ups must work: a commit wakes a sleeping relay
            rebalance_interval=self.rng.choice((0.5, 2.0)),
            delivery_timeout_ms=2000,
            retry=RetryPolicy(max_attempts=3, base_seconds=0.05, cap_seconds=0.2),
            delete_on_send=delete_on_send,
            shutdown_timeout=6.0,
        )
        self.table = SimTable(self)
        self.table.delete_on_send = delete_on_send
        self.locks = SimLocks()
        self.broker = SimBroker(self, partitions=3)
        self.topics = {"orders", "small", "opaque"}
        self.broker.limits["small"] = 2000
        self.broker.limits["opaque"] = 2000
        # A progress record lists every message of its transaction: a limit this small
        # refuses those of the larger batches (the relay must make its transactions smaller).
        self.broker.limits[PROGRESS] = 330  # (six acks or more)
        self.broker.unsaid.add("opaque")
        self.relays: list[SimRelay] = []
        self.producers: list[FakeProducer] = []
        self.violations: list[str] = []
        self.copies: dict[uuid.UUID, list[Sent]] = defaultdict(list)
        self.dead_kinds: dict[uuid.UUID, str] = {}
        self.deleted_sent: set[uuid.UUID] = set()
        self.stepped_aside: list[tuple[str, float]] = []
        #: Whether the run has had faults that excuse duplicates (at-least-once).
        self.excuses: dict[str, float] = {}
        self.reads = 0
        self.batches = 0
        self._names = itertools.count(1)
        self._ids: dict[int, uuid.UUID] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_numbers = itertools.count()
        self.open_writes: list[tuple[list[SimRow], float]] = []
        self.busy_keys: set[bytes] = set()
        self.first_ack: dict[uuid.UUID, tuple[str, float]] = {}
        self.notes: list[str] = []
        #: Rows committed to a sleeping relay (see commit_seen), and when.
        self.wake_watch: dict[uuid.UUID, tuple[float, float]] = {}
        #: Scheduled messages of one key, the first due first: they go in that order.
        self.due_pairs: list[tuple[uuid.UUID, uuid.UUID]] = []
        self.blocked = 0.0
        self.first_sent: dict[uuid.UUID, float] = {}
        self.faulty_since = float("-inf")
        self.seq_of: dict[uuid.UUID, int] = {}
        self.keys: dict[uuid.UUID, tuple[str, bytes | None]] = {}

    # -- what the fakes tell the world -----------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Time passing while a client blocks (a transactional producer's flush or commit):
        the other relays could have acted meanwhile, so it does not count as their delay."""
        self.now += max(0.0, seconds)
        self.blocked += max(0.0, seconds)

    def id_of(self, message: FakeMessage) -> uuid.UUID | None:
        value = message.value()
        if message.topic() == PROGRESS or value is None or len(value) < 16:
            return None
        return uuid.UUID(bytes=value[:16])

    def appended(self, topic: str, partition: int, offset: int, entry: Entry) -> None:
        if entry.state == "committed":
            self.committed(entry, partition=partition, offset=offset)
        else:
            entry._where = (partition, offset)  # type: ignore[attr-defined]

    def stalled_records(self, messages: Sequence[FakeMessage]) -> None:
        for message in messages:
            record_id = self.id_of(message)
            if record_id is not None and record_id in self.table.rows:
                self.table.rows[record_id].stalled = True

    def commit_seen(self, rows: Sequence[SimRow]) -> None:
        """Rows committed while the relay owning their shard sleeps, with nothing else to do
        and nothing failing: a writer's wake-up must bring them out at once."""
        locked = any(until > self.now for until in self.table.locked.values())
        if self.faulty_since > self.now - 2.0 or locked:
            return
        for row in rows:
            owner = self.locks.shards.get(row.shard)
            sim = next((r for r in self.live() if r.session.number == owner), None)
            behind = any(
                r.status in ("pending", "uncommitted") and r.key == row.key and r.seq < row.seq
                for r in self.table.rows.values()
            )
            if (
                sim is not None
                and not behind
                and sim.source.asleep
                and sim.relay.core.idle
                and not sim.relay.core.suspects  # (sent alone, nothing else meanwhile)
                and sim.relay.core.reach.may_send(self.now)
                and row.deliver_at is None
                and (row.lease_until is None or row.lease_until <= self.now)
                and row.topic == "orders"
                and not sim.stop.is_set()
            ):
                self.wake_watch[row.id] = (self.now, self.blocked)

    def notify(self) -> None:
        """A commit: every relay asleep, watching, is woken."""
        for sim in self.relays:
            if sim.source.asleep:
                sim.source.notified = True
                sim.wake_at = self.now

    # -- the relays ------------------------------------------------------------------------

    def watch(self, sim: SimRelay) -> None:
        """Hook the relay so that what it learns and loses is known to the checks."""
        relay = sim.relay
        lost = relay._lost_database

        def lost_database(error: Exception) -> None:
            self.note(f"{sim.name} lost its database: {error}")
            self.excuse(sim.name)
            sim.acked.clear()
            sim.wake_at = self.now + 0.5  # the loop's pause before it connects again
            lost(error)

        relay._lost_database = lost_database  # type: ignore[method-assign]

    def start_relay(self) -> SimRelay:
        sim = SimRelay(self, f"relay-{next(self._names)}")
        self.relays.append(sim)
        return sim

    def live(self) -> list[SimRelay]:
        return [r for r in self.relays if not r.crashed and not r.exited]

    def excuse(self, relay: str) -> None:
        """Copies this relay sent may land again, from others or itself (its sessions or
        producer were lost, it crashed, stepped aside or purged)."""
        self.excuses[relay] = self.now

    # -- the checks ------------------------------------------------------------------------

    def violation(self, text: str) -> None:
        self.violations.append(f"t={self.now:.3f} {text}")

    def note(self, text: str) -> None:
        """What happened, kept for reading a failing run (the last few thousand lines)."""
        self.notes.append(f"t={self.now:.3f} {text}")
        if len(self.notes) > 4000:
            del self.notes[:1000]

    def acked(self, sim: SimRelay, ids: Sequence[uuid.UUID]) -> None:
        """The relay's core is told that Kafka has these messages."""
        if ids:
            self.note(f"{sim.name} told acks {[str(i)[:8] for i in ids]}")
        for row_id in ids:
            sim.acked.add(row_id)
            self.first_ack.setdefault(row_id, (sim.name, self.now))

    def committed(
        self, entry: Entry, partition: int | None = None, offset: int | None = None
    ) -> None:
        if entry.record_id is None:
            return
        where = getattr(entry, "_where", (partition, offset))
        copies = self.copies[entry.record_id]
        copies.append(Sent(entry.producer, self.now, where[0] or 0, where[1] or 0))
        self.note(f"copy of {str(entry.record_id)[:8]} by {entry.producer} at {where}")
        if len(copies) < 2:
            return
        if self.exactly_once:
            self.violation(f"exactly-once: {entry.record_id} committed {len(copies)} times")

    def check_send(self, sim: SimRelay, batch: Any) -> None:
        """Every batch is sent by the relay whose owner session holds its shards."""
        self.batches += 1
        for row in batch.rows:
            self.first_sent.setdefault(row.id, self.now - self.blocked)
            acked = self.first_ack.get(row.id)
            if acked is not None and self.excuses.get(acked[0], -1.0) < acked[1]:
                self.violation(
                    f"{sim.name} sends {row.id} again though {acked[0]} was told Kafka had it,"
                    " with nothing of that relay lost since"
                )
        self.note(
            f"{sim.name} sends batch {batch.number} shards {sorted(batch.shards)}"
            f" rows {[str(r.id)[:8] for r in batch.rows]}"
        )
        held = {s for s, holder in self.locks.shards.items() if holder == sim.session.number}
        if not sim.session.alive or not batch.shards <= held:
            self.violation(
                f"{sim.name} sent a batch of shards {sorted(batch.shards - held)} it does not hold"
            )

    def check_order(self) -> None:
        """Each key's messages first reached their partition in their order: a message that
        became pending before another of its key, with a lower seq, went before it (dead
        ones aside: a dead message holds back nothing). Two writers of a key that do not take
        turns (a promotion while a transaction of the key is open, whose rows have lower seqs
        and commit later) are in no order, as docs/relay.md says."""
        position = {row_id: n for n, row_id in enumerate(self.table.visible_order)}
        by_key: dict[tuple[str, bytes], list[tuple[int, int, uuid.UUID]]] = defaultdict(list)
        for row_id, copies in self.copies.items():
            topic, key = self.keys[row_id]
            if key is None or not copies or row_id in self.dead_kinds or row_id not in position:
                continue
            by_key[(topic, key)].append((copies[0].partition, copies[0].offset, row_id))
        for key, sent in by_key.items():
            delivered = [row_id for _, _, row_id in sorted(sent)]
            for later_index, later in enumerate(delivered):
                for earlier in delivered[:later_index]:
                    if (
                        self.seq_of[later] < self.seq_of[earlier]
                        and position[later] < position[earlier]
                    ):
                        self.violation(
                            f"key {key}: {str(later)[:8]} reached its partition after "
                            f"{str(earlier)[:8]}, which came after it"
                        )
                        return

    def check_end(self) -> None:
        """After the faults stopped and the relays ran free: every committed row was sent (or
        is dead, for a reason it has), and no message was charged for an outage."""
        for row in self.table.rows.values():
            copies = self.copies.get(row.id, [])
            if row.status in ("pending", "scheduled", "uncommitted"):
                self.violation(f"{row.id} still {row.status} at the end (attempts {row.attempts})")
            elif row.status == "sent" and not copies:
                self.violation(f"{row.id} marked sent but on no topic")
            elif row.status == "dead":
                self._check_dead(row)
            if not row.stalled and row.attempts > 1 and row.status != "dead":
                self.violation(
                    f"{row.id} charged {row.attempts} attempts with no failure of its own"
                )
        for row_id in self.deleted_sent:
            if not self.copies.get(row_id):
                self.violation(f"{row_id} deleted as sent but on no topic")
        self.check_order()
        for first, second in self.due_pairs:
            before, after = self.copies.get(first), self.copies.get(second)
            if (
                before
                and after
                and (before[0].partition, before[0].offset)
                > (
                    after[0].partition,
                    after[0].offset,
                )
            ):
                self.violation(
                    f"{str(second)[:8]} went before {str(first)[:8]}, due before it (a key's "
                    "scheduled messages go in their due order)"
                )
                break
        for row_id, (at, blocked) in self.wake_watch.items():
            committed = at - blocked
            sent = self.first_sent.get(row_id)
            if sent is not None and sent - committed > WAKE_BOUND:
                self.violation(
                    f"{row_id} committed to a sleeping relay was sent {sent - committed:.3f}s"
                    " later: the commit did not wake it"
                )
                break

    def _check_dead(self, row: SimRow) -> None:
        kind = self.dead_kinds.get(row.id, row.error_kind)
        limit = self.broker.limits.get(row.topic, DEFAULT_LIMIT)
        alone = BATCH_HEADER + len(row.value) + len(row.key or b"") + RECORD_OVERHEAD
        if kind == "undecodable":
            fair = row.undecodable
        elif kind == "message_too_large":
            fair = alone > limit
        elif kind == "unknown_topic":
            fair = row.topic not in self.topics
        elif kind == "attempts_exhausted":
            fair = row.stalled and row.attempts == self.config.retry.max_attempts
        else:
            fair = False
        if not fair:
            self.violation(f"{row.id} dead as {kind} (attempts {row.attempts}), not its due")

    first_ack: dict[uuid.UUID, tuple[str, float]]
    keys: dict[uuid.UUID, tuple[str, bytes | None]]

    # -- what happens in the world ---------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (when, next(self._timer_numbers), action))

    def advance_to(self, when: float) -> None:
        """Move the clock to ``when``, running the timers that fall due on the way."""
        while self._timers and self._timers[0][0] <= when:
            due, _, action = heapq.heappop(self._timers)
            self.now = max(self.now, due)
            action()
        self.now = max(self.now, when)

    def write(self, keys: Sequence[bytes] | None = None, commit: bool | None = None) -> None:
        """A business transaction writing one to four messages; it commits now, or stays
        open (its keys' other writers wait for it, as a lock on the business row makes
        them)."""
        rng = self.rng
        free = [k for k in (b"k%d" % n for n in range(10)) if k not in self.busy_keys]
        if not free:
            return
        keys = keys or rng.sample(free, min(len(free), rng.choice((1, 1, 1, 2))))
        rows = []
        for _ in range(rng.choice((1, 1, 2, 4))):
            key = rng.choice(keys)
            topic = rng.choices(("orders", "small", "opaque", "missing"), (80, 10, 6, 1))[0]
            poison = topic in ("small", "opaque") and rng.random() < 0.15
            size = 2100 if poison else rng.randrange(20, 60)
            deliver_at = self.now + rng.choice((0.05, 0.3, 1.0)) if rng.random() < 0.1 else None
            row = self.table.insert(topic, key, size, deliver_at=deliver_at)
            row.undecodable = rng.random() < 0.01
            self.keys[row.id] = (topic, key)
            rows.append(row)
        if commit is None:
            commit = rng.random() < 0.9
        if commit:
            self.table.commit(rows)
        else:
            self.busy_keys.update(keys)
            self.open_writes.append((rows, self.now))

    def commit_open(self) -> None:
        if not self.open_writes:
            return
        rows, _ = self.open_writes.pop(self.rng.randrange(len(self.open_writes)))
        self.table.commit(rows)
        self.busy_keys.difference_update(row.key for row in rows if row.key is not None)

    def lock_row(self) -> None:
        """Another transaction (an operator's UPDATE, a cancel in progress) locks a row."""
        rows = [r for r in self.table.rows.values() if r.status in ("pending", "scheduled")]
        if not rows:
            return
        row = self.rng.choice(rows)
        until = self.now + self.rng.choice((0.05, 0.3, 1.0, 3.0))
        self.table.locked[row.id] = until
        if row.status == "scheduled" and self.rng.random() < 0.3:

            def cancelled() -> None:
                if row.status == "scheduled":
                    row.status = "cancelled"

            self.at(until, cancelled)

    def scheduled_pair(self) -> None:
        """Two scheduled messages of one key due close together, the first held by a cancel
        that rolls back after both are due: they must still go in their due order."""
        free = [k for k in (b"k%d" % n for n in range(10)) if k not in self.busy_keys]
        if not free:
            return
        key = self.rng.choice(free)
        first = self.table.insert("orders", key, 30, deliver_at=self.now + 0.1)
        second = self.table.insert("orders", key, 30, deliver_at=self.now + 0.15)
        self.table.commit([first, second])
        self.table.locked[first.id] = self.now + self.rng.choice((0.2, 0.5))
        self.due_pairs.append((first.id, second.id))

    def lease_row(self) -> None:
        """A message written for the immediate sender: leased to it from the start; it sends
        it (unless an earlier message of its key waits) or its lease runs out."""
        free = [k for k in (b"k%d" % n for n in range(10)) if k not in self.busy_keys]
        if not free:
            return
        key = self.rng.choice(free)
        row = self.table.insert("orders", key, 30)
        self.keys[row.id] = ("orders", key)
        row.lease_until = self.now + self.rng.choice((0.2, 1.0))
        self.table.commit([row])
        if self.rng.random() < 0.7:
            self.at(self.now + 0.003, lambda: self._immediate(row))

    def _immediate(self, row: SimRow) -> None:
        if row.status != "pending" or row.lease_until is None or row.lease_until <= self.now:
            return
        earlier = any(
            r.status == "pending" and r.topic == row.topic and r.key == row.key and r.seq < row.seq
            for r in self.table.rows.values()
        )
        if earlier or self.table.now_locked(row.id):
            row.lease_until = None  # released to the relay
            self.notify()
            return
        entry = Entry(row.id, row.key, row.value, "immediate")
        self.broker.append(entry, row.topic, self.broker.partition_of(row.topic, row.key))
        row.status, row.attempts, row.lease_until = "sent", row.attempts + 1, None

    def crash(self, sim: SimRelay) -> None:
        """Its process is killed: nothing of its shutdown runs."""
        self.note(f"{sim.name} crashes")
        sim.crashed = True
        self.excuse(sim.name)
        for _, recording, session in sim.recorder.running:
            if session in self.locks.alive and self.rng.random() < 0.5:
                self.table.record(recording)  # the statement had committed
        sim.recorder.running = []
        self.locks.kill(sim.session.number)
        for producer in [p for p in self.producers if p.relay == sim.name]:
            stopped: set[tuple[str, int]] = set()
            for request in producer.requests:
                where = (request.topic, request.partition)
                if where in stopped or request.refused or self.rng.random() >= 0.5:
                    stopped.add(where)
                    continue
                producer._land(request, reported=False)
            producer.requests, producer.queued = [], []
            self.producers.remove(producer)

    def fault(self) -> None:
        rng, live = self.rng, self.live()
        choice = rng.choice(
            ("outage", "stall", "stall", "cut", "cut", "kill", "crash", "stop", "start", "start")
        )
        self.note(f"fault {choice}")
        self.faulty_since = self.now
        for row_id in [r for r in self.wake_watch if not self.copies.get(r)]:
            del self.wake_watch[row_id]  # a fault on its way: no longer a plain wake-up
        if choice == "outage" and not self.broker.down:
            self.broker.down = True
            self.at(self.now + rng.choice((1.0, 3.0, 6.0)), self._heal_outage)
        elif choice == "stall":
            where = ("orders", rng.randrange(self.broker.partitions))
            self.broker.stalled.add(where)
            self.at(
                self.now + rng.choice((0.5, 3.0, 8.0)), lambda: self.broker.stalled.discard(where)
            )
        elif choice == "cut" and live:
            name = rng.choice(live).name
            self.broker.cut.add(name)
            self.at(self.now + rng.choice((3.0, 12.0, 20.0)), lambda: self.broker.cut.discard(name))
        elif choice == "kill" and live:
            sim = rng.choice(live)
            self.note(f"{sim.name}'s sessions killed")
            self.excuse(sim.name)  # what it was told and did not record yet may go again
            self.locks.kill(sim.session.number)
        elif choice == "crash" and len(live) > 1:
            self.crash(rng.choice(live))
        elif choice == "stop" and len(live) > 1:
            sim = rng.choice(live)
            self.excuse(sim.name)  # marks held by a row lock are left to the next owner
            sim.relay.stop()
        elif choice == "start" and len(live) < 3:
            self.start_relay()

    def _heal_outage(self) -> None:
        self.broker.down = False

    def turn(self, sim: SimRelay) -> None:
        """One round of the relay's loop (as ``Relay.run`` makes them)."""
        relay = sim.relay
        sim.wake_at = float("inf")
        sim.source.sleeping_until = None
        relay.step()
        if relay.exit_code is not None:
            self.violation(f"{sim.name} exited with {relay.exit_code}")
            sim.exited = True
            return
        if relay._finished():
            while sim.transactions.run_one() or sim.background.run_one():
                pass
            relay.shutdown()
            sim.exited = True
            return
        until, _ = relay.core.wait_until(self.now)
        wake = min(until, self.now + self.config.poll_interval)
        if sim.source.sleeping_until is not None:
            wake = min(wake, sim.source.sleeping_until)
        elif relay.core.next_read(self.now) is not None:
            wake = self.now
        sim.wake_at = min(sim.wake_at, wake)

    def actions(
        self, faults: bool, writes: bool = False
    ) -> list[tuple[float, Callable[[], object]]]:
        """What may happen next, and how likely."""
        now = self.now
        enabled: list[tuple[float, Callable[[], object]]] = []
        for sim in self.live():
            if sim.wake_at <= now or sim.events.items:
                enabled.append((8.0, lambda s=sim: self.turn(s)))
            sender = sim.relay.sender
            if sender is not None and sender.in_flight:
                enabled.append((6.0, lambda s=sim: s.relay.serve_sender(0)))
            if sim.background.tasks:
                enabled.append((3.0, sim.background.run_one))
            if sim.transactions.tasks:
                enabled.append((6.0, sim.transactions.run_one))
            if any(due <= now for due, _, _ in sim.recorder.running):
                enabled.append((6.0, sim.recorder.finish_one))
        if faults:
            enabled.append((4.0, self.write))
            enabled.append((1.0, self.commit_open))
            enabled.append((0.7, self.lock_row))
            enabled.append((0.7, self.lease_row))
            enabled.append((0.3, self.scheduled_pair))
            enabled.append((0.15, self.fault))
        elif writes:
            enabled.append((1.0, self.write))
        # Time moves on only a little while a relay has something to do at once: a relay reacts
        # to what it is told before much else happens.
        due = self._due_now()
        steps = (0.0005,) if due else (0.001, 0.005, 0.02, 0.1)
        enabled.append((4.0, lambda: self.advance_to(now + self.rng.choice(steps))))
        if not due and faults:
            # Now and then a quiet second or two: long faults (a path cut, a stalled
            # partition) outlast the relays' patience within a run.
            enabled.append((0.3, lambda: self.advance_to(now + self.rng.choice((0.5, 2.0)))))
        return enabled

    def step(self, faults: bool = True, writes: bool = False) -> None:
        enabled = self.actions(faults, writes)
        weights = [weight for weight, _ in enabled]
        _, action = self.rng.choices(enabled, weights)[0]
        action()

    def run(self, steps: int) -> None:
        for _ in range(self.rng.choice((1, 2, 3))):
            self.start_relay()
        for _ in range(steps):
            self.step()
            if self.violations:
                return
        # Then a calm spell: the faults end, writers go on (a commit must wake a relay that
        # sleeps at once).
        self.heal()
        for _ in range(steps // 4):
            self.step(faults=False, writes=True)
            if self.violations:
                return

    def heal(self) -> None:
        self.broker.down = False
        self.broker.stalled.clear()
        self.broker.cut.clear()
        self.table.locked.clear()
        self.faulty_since = self.now - 2.0

    def finish(self, seconds: float = 300.0) -> None:
        """The faults stop and every relay runs free: everything committed must go."""
        self.heal()
        while self.open_writes:
            self.commit_open()
        for row in self.table.rows.values():
            row.lease_until = None
        if not [r for r in self.live() if not r.stop.is_set()]:
            self.start_relay()
        self.notify()
        deadline = self.now + seconds
        steps = 0
        while self.now < deadline and not self.violations and steps < 30_000:
            if self._settled():
                break
            steps += 1
            if not self._due_now():
                self._jump()
            self.step(faults=False)
        self.check_end()

    def _due_now(self) -> bool:
        """Whether anything can happen without the clock moving."""
        now = self.now
        for sim in self.live():
            if sim.wake_at <= now or sim.events.items or sim.background.tasks:
                return True
            if sim.transactions.tasks or any(d <= now for d, _, _ in sim.recorder.running):
                return True
            if any(p.answerable() for p in self.producers if p.relay == sim.name):
                return True
        return False

    def _jump(self) -> None:
        """Move the clock to the next moment something falls due."""
        times = [sim.wake_at for sim in self.live()]
        times += [d for sim in self.live() for d, _, _ in sim.recorder.running]
        times += [t for t, _, _ in self._timers]
        later = [t for t in times if t > self.now]
        if later:
            self.advance_to(min(later))

    def _settled(self) -> bool:
        if any(
            r.status in ("pending", "scheduled", "uncommitted") for r in self.table.rows.values()
        ):
            return False
        return all(sim.relay.core.idle for sim in self.live())
