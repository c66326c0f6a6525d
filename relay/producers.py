"""Producing a leased batch to Kafka, at-least-once or exactly-once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from outbox.flights import IdempotentSender
from outbox.records import OutboxRecord
from outbox.relay.progress import encode_progress, last_committed_of
from outbox.schema import SHARD_COUNT
from outbox.sending import Ack, BatchResult, kafka_error_of, produce_batch, sending_config

log = logging.getLogger(__name__)
#: librdkafka's own lines (connection failures, ...) go through this logger, so that they come
#: out as JSON lines like the relay's (they are handed over while the client is polled).
KAFKA_LOG = logging.getLogger("outbox.kafka")


#: How much longer than the delivery timeout a Kafka transaction may stay open.
TRANSACTION_MARGIN_MS = 30_000
#: The broker's default transaction.max.timeout.ms: no transaction may be longer.
MAX_TRANSACTION_MS = 900_000
#: ``linger.ms`` of the transactional producers unless set: a batch's records fill larger
#: requests while they are produced, and its end costs nothing, since the ``flush()`` that
#: waits for them (and the commit's own) sends at once whatever lingers. Measured (16 shards,
#: batches of 2,000): about 10% more messages a second for less CPU than with 0.
TRANSACTION_LINGER_MS = 5


class InFlight(Protocol):
    """A batch started on a publisher; ``result`` is valid once ``done()``."""

    @property
    def records(self) -> Sequence[OutboxRecord]: ...

    @property
    def result(self) -> BatchResult: ...

    def done(self) -> bool: ...


class BatchPublisher(Protocol):
    """What the relay's loop needs of Kafka (at-least-once or exactly-once)."""

    def check_reachable(self, timeout: float) -> None:
        """Raise KafkaException unless a broker answers a metadata request in time."""
        ...

    def serve_events(self) -> None:
        """Hand queued client events (librdkafka's log lines) over, also while idle."""
        ...

    def take_over(self, shards: Sequence[int]) -> list[Ack]: ...

    def let_go(self, shards: Sequence[int]) -> None: ...

    def start(self, records: Sequence[OutboxRecord]) -> list[InFlight]:
        """Start sending ``records`` (of shards with nothing else in flight)."""
        ...

    def wait(self, timeout: float) -> list[InFlight]:
        """Wait up to ``timeout`` seconds for a batch to end; return those that ended."""
        ...

    @property
    def in_flight(self) -> int: ...

    def stop_sending(self) -> None:
        """This relay lost its shards: stop what is in flight where that can be stopped."""
        ...

    def close(self) -> None: ...


def publish(publisher: BatchPublisher, records: Sequence[OutboxRecord]) -> BatchResult:
    """Send ``records`` and wait for every outcome (stop-and-wait): one merged result."""
    flights = publisher.start(records)
    while not all(flight.done() for flight in flights):
        publisher.wait(1.0)
    merged = BatchResult()
    for flight in flights:
        merged.acks.extend(flight.result.acks)
        merged.errors.update(flight.result.errors)
        merged.not_attempted.extend(flight.result.not_attempted)
        merged.lost_shards.extend(flight.result.lost_shards)
    return merged


class AtLeastOncePublisher:
    """One idempotent producer (acks=all) for every shard this relay owns, with several
    batches in flight on it (see :mod:`outbox.flights`)."""

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        delivery_timeout_ms: int,
        give_up: Callable[[], bool] = lambda: False,
    ) -> None:
        self.sender = IdempotentSender(
            kafka_config, delivery_timeout_ms, give_up, extra_config={"logger": KAFKA_LOG}
        )

    def check_reachable(self, timeout: float) -> None:
        self.sender.check_reachable(timeout)

    def serve_events(self) -> None:
        self.sender.serve_events()

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        return []

    def let_go(self, shards: Sequence[int]) -> None:
        return None

    @property
    def producer(self) -> Producer:
        return self.sender.producer

    def publish(self, records: Sequence[OutboxRecord]) -> BatchResult:
        """Send ``records`` and wait for every outcome (stop-and-wait)."""
        return self.sender.publish(records)

    def start(self, records: Sequence[OutboxRecord]) -> list[InFlight]:
        return [self.sender.start(records)]

    def wait(self, timeout: float) -> list[InFlight]:
        return list(self.sender.wait(timeout))

    @property
    def in_flight(self) -> int:
        return self.sender.in_flight

    def stop_sending(self) -> None:
        self.sender.purge()

    def close(self) -> None:
        self.sender.close()


class Outcome(Enum):
    """How an exactly-once batch's transaction ended."""

    COMMITTED = "committed"
    ABORTED = "aborted"
    #: The producer could not finish it (fenced, fatal, or Kafka did not answer in time): the
    #: shard must be let go; the next owner's ``init_transactions`` settles the transaction,
    #: and its progress record tells whether the batch is on the topics.
    LOST = "lost"


_FENCED = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}


class ExactlyOncePublisher:
    """One transactional producer per owned shard; each batch is one Kafka transaction.

    ``transactional.id`` is ``<prefix>-<shard>``: the next owner of a shard fences the last.
    """

    #: Seconds each commit_transaction / abort_transaction call may take. A call that timed
    #: out is made again (librdkafka requires it: until the same call completes, every other
    #: transactional call fails) until the transaction's own timeout would have ended it, or
    #: a shutdown gives up; then the shard is let go.
    finish_call_timeout = 10.0

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        *,
        transactional_id_prefix: str,
        progress_topic: str,
        owner: str,
        delivery_timeout_ms: int,
        give_up: Callable[[], bool] = lambda: False,
    ) -> None:
        self.give_up = give_up
        self.kafka_config = dict(kafka_config)
        self.prefix = transactional_id_prefix
        self.progress_topic = progress_topic
        self.owner = owner
        self.delivery_timeout_ms = delivery_timeout_ms
        # A transaction must outlive the deliveries inside it (librdkafka insists).
        self.transaction_timeout_ms = delivery_timeout_ms + TRANSACTION_MARGIN_MS
        self.producers: dict[int, Producer] = {}
        self._flights: list[ShardFlight] = []
        # A thread per shard: every owned shard can have its transaction open at once.
        self._pool = ThreadPoolExecutor(max_workers=SHARD_COUNT, thread_name_prefix="outbox-eos")
        consumer_config = {
            key: value
            for key, value in self.kafka_config.items()
            if not key.startswith(("linger", "compression", "acks", "enable.idempotence"))
            and key not in {"max.in.flight.requests.per.connection", "delivery.timeout.ms"}
        }
        self._consumer_config = {
            **consumer_config,
            "group.id": f"{self.prefix}-progress-reader",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "logger": KAFKA_LOG,
        }
        self._consumer = Consumer(self._consumer_config)
        #: The take-overs' own: the loop polls ``_consumer`` for events while they read. It
        #: reads to a partition's end: the broker need not hold its empty fetches long.
        self._progress_config = {**self._consumer_config, "fetch.wait.max.ms": 10}
        self._progress = Consumer(self._progress_config)
        self._progress_lock = threading.Lock()

    def check_reachable(self, timeout: float) -> None:
        try:
            self._consumer.list_topics(timeout=timeout)
        finally:
            self.serve_events()

    def serve_events(self) -> None:
        self._consumer.poll(0)  # assigned to nothing between take-overs: only events
        # A copy: a transaction thread drops the producer of a shard it lost meanwhile.
        for producer in list(self.producers.values()):
            producer.poll(0)

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        """Fence earlier owners of ``shards`` and return what their last transactions sent.

        Safe beside the loop's batches (the relay runs it on a thread of its own): the shards'
        producers are registered only once they fenced the earlier owner, and the progress
        records are read with a consumer of the take-overs' own."""
        began = time.monotonic()
        fenced: dict[int, Producer] = {}
        # Side by side: each waits for the coordinator, which may first have to abort the
        # earlier owner's open transaction (a relay killed mid-batch).
        with ThreadPoolExecutor(max_workers=len(shards) or 1) as pool:
            inits = {shard: pool.submit(self._fenced_producer, shard) for shard in shards}
        failure: BaseException | None = None
        for shard, init in inits.items():
            error = init.exception()
            if error is None:
                fenced[shard] = init.result()
            elif failure is None:
                failure = error
        self.producers.update(fenced)  # the relay lets them go when the take-over failed
        if failure is not None:
            raise failure
        recovered: list[Ack] = []
        fenced_at = time.monotonic()
        with self._progress_lock:
            try:
                found = last_committed_of(self._progress, self.progress_topic, shards)
            except (KafkaException, TimeoutError):
                # After a broker restart a client's metadata can stay wrong ("Unknown
                # partition" for minutes, seen in a chaos run); the next try gets a new one.
                self._progress.close()
                self._progress = Consumer(self._progress_config)
                raise
        for acks in found.values():
            recovered.extend(acks)
        log.info(
            "shards %s: earlier owners fenced in %.2fs, progress read in %.2fs",
            list(shards),
            fenced_at - began,
            time.monotonic() - fenced_at,
        )
        return recovered

    def _fenced_producer(self, shard: int) -> Producer:
        producer = Producer(self.producer_config(shard))
        producer.init_transactions(60)  # fences the old owner, ends its open transaction
        return producer

    def producer_config(self, shard: int) -> dict[str, Any]:
        """The settings of ``shard``'s transactional producer."""
        config = {
            **sending_config(self.kafka_config, self.delivery_timeout_ms),
            "transactional.id": f"{self.prefix}-{shard}",
            "transaction.timeout.ms": self.transaction_timeout_ms,
            "logger": KAFKA_LOG,
        }
        if not {"linger.ms", "queue.buffering.max.ms"} & self.kafka_config.keys():
            config["linger.ms"] = TRANSACTION_LINGER_MS
        return config

    def let_go(self, shards: Sequence[int]) -> None:
        for shard in shards:
            producer = self.producers.pop(shard, None)
            if producer is not None:
                _flush_as_it_stands(shard, producer, 5)

    def start(self, records: Sequence[OutboxRecord]) -> list[InFlight]:
        """One Kafka transaction per shard, each in a thread of its own."""
        by_shard: dict[int, list[OutboxRecord]] = {}
        for record in records:
            by_shard.setdefault(record.shard, []).append(record)
        flights = [
            # The producer is picked now: a batch that waits for a thread must not use the
            # producer of a later take-over of its shard.
            ShardFlight(
                batch,
                self._pool.submit(self._one_shard, shard, batch, self.producers.get(shard)),
            )
            for shard, batch in by_shard.items()
        ]
        self._flights.extend(flights)
        return list(flights)

    def publish(self, records: Sequence[OutboxRecord]) -> BatchResult:
        """Send ``records`` and wait for every shard's transaction (stop-and-wait)."""
        return publish(self, records)

    def wait(self, timeout: float) -> list[InFlight]:
        if not self._flights:
            return []
        futures.wait([f.future for f in self._flights], timeout, futures.FIRST_COMPLETED)
        # One look per flight: one that ended between two looks would be in neither list,
        # and its shards would stay busy for good.
        ended: list[InFlight] = []
        running: list[ShardFlight] = []
        for flight in self._flights:
            (ended if flight.done() else running).append(flight)
        self._flights = running
        return ended

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    def stop_sending(self) -> None:
        """Nothing to do: a take-over fences this relay's transactional producers."""

    def _one_shard(
        self, shard: int, records: list[OutboxRecord], producer: Producer | None
    ) -> BatchResult:
        """One Kafka transaction: the records and the shard's progress record, or nothing."""
        result = BatchResult()
        if producer is None:
            result.not_attempted.extend(r.id for r in records)
            return result
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            return self._lost(shard, producer, records, result, exc.args[0])
        # After this the coordinator aborts the transaction by itself: no use resuming a call.
        expires = time.monotonic() + self.transaction_timeout_ms / 1000
        try:
            produce_batch(
                producer,
                records,
                result,
                self.delivery_timeout_ms / 1000,
                self.give_up,
                purge_in_flight=False,  # the abort below waits for them, as librdkafka's does
            )
            complete = not result.errors and len(result.acks) == len(records)
            if complete:
                producer.produce(
                    self.progress_topic,
                    key=str(shard).encode(),
                    value=encode_progress(shard, self.owner, result.acks),
                    partition=shard,
                )
        except (KafkaException, SystemError) as exc:
            error = kafka_error_of(exc)
            if error is None:
                raise
            log.warning("exactly-once batch of shard %d failed: %s", shard, error)
            result.errors.clear()  # only the transaction's end says what happened now
            complete = False
        outcome = self._finish(producer, commit=complete, expires=expires)
        if outcome is Outcome.COMMITTED:
            return result
        if outcome is Outcome.LOST:
            return self._lost(shard, producer, records, result, None)
        # Aborted: the rows that failed keep their error (retry, dead); the rest go again.
        result.acks.clear()
        result.not_attempted = [r.id for r in records if r.id not in result.errors]
        return result

    def _finish(self, producer: Producer, commit: bool, expires: float) -> Outcome:
        """Commit (or abort) the open transaction, resuming a call that timed out."""
        while True:
            timeout = min(self.finish_call_timeout, expires - time.monotonic())
            if timeout <= 0:
                log.warning("transaction not finished before its timeout")
                return Outcome.LOST
            try:
                if commit:
                    producer.commit_transaction(timeout)
                    return Outcome.COMMITTED
                producer.abort_transaction(timeout)
                return Outcome.ABORTED
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal() or error.code() in _FENCED:
                    log.warning("transactional producer unusable: %s", error)
                    return Outcome.LOST
                if commit and error.txn_requires_abort():
                    commit = False  # the transaction cannot commit: abort it instead
                    continue
                if not error.retriable() or self.give_up():
                    log.warning("transaction not finished: %s", error)
                    return Outcome.LOST
                log.warning("%s timed out; resuming it: %s", "commit" if commit else "abort", error)

    def _lost(
        self,
        shard: int,
        producer: Producer,
        records: list[OutboxRecord],
        result: BatchResult,
        error: KafkaError | None,
    ) -> BatchResult:
        """This producer cannot go on: the batch is released and the shard let go."""
        if error is not None:
            log.warning("shard %d: transactional producer cannot go on: %s", shard, error)
        if self.producers.get(shard) is producer:  # not a newer producer of a take-over
            self.producers.pop(shard, None)
        result.acks.clear()
        result.errors.clear()
        result.not_attempted = [r.id for r in records]
        result.lost_shards.append(shard)
        return result

    def close(self) -> None:
        futures.wait([f.future for f in self._flights])
        for shard, producer in self.producers.items():
            _flush_as_it_stands(shard, producer, 10)
        self.producers.clear()
        self._pool.shutdown(wait=True)
        self._consumer.close()
        with self._progress_lock:
            self._progress.close()


def _flush_as_it_stands(shard: int, producer: Producer, timeout: float) -> None:
    """Wait up to ``timeout`` for what ``producer`` still sends, unless it failed for good.

    Fenced or failed for good (often why the shard is let go), its flush raises: nothing of
    it is waited for any more, and the next owner's take-over settles its transaction. A
    delivery report that runs after that error turns it into a SystemError."""
    try:
        producer.flush(timeout)
    except (KafkaException, SystemError) as exc:
        error = kafka_error_of(exc)
        if error is None:
            raise
        log.info("shard %d: producer let go as it stands: %s", shard, error)


@dataclass(eq=False)
class ShardFlight:
    """One shard's Kafka transaction, running in the publisher's thread pool."""

    records: Sequence[OutboxRecord]
    future: Future[BatchResult]

    @property
    def result(self) -> BatchResult:
        return self.future.result()

    def done(self) -> bool:
        return self.future.done()
