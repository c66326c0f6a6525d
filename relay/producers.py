"""Producing a leased batch to Kafka, at-least-once or exactly-once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from outbox.records import OutboxRecord
from outbox.sending import Ack, BatchResult, kafka_error_of, produce_batch, sending_config
from relay.progress import encode_progress, last_committed

log = logging.getLogger(__name__)
#: librdkafka's own lines (connection failures, ...) go through this logger, so that they come
#: out as JSON lines like the relay's (they are handed over while the client is polled).
KAFKA_LOG = logging.getLogger("outbox.kafka")


#: How much longer than the delivery timeout a Kafka transaction may stay open.
TRANSACTION_MARGIN_MS = 30_000
#: The broker's default transaction.max.timeout.ms: no transaction may be longer.
MAX_TRANSACTION_MS = 900_000


class BatchPublisher(Protocol):
    def check_reachable(self, timeout: float) -> None:
        """Raise KafkaException unless a broker answers a metadata request in time."""
        ...

    def serve_events(self) -> None:
        """Hand queued client events (librdkafka's log lines) over, also while idle."""
        ...

    def take_over(self, shards: Sequence[int]) -> list[Ack]: ...

    def let_go(self, shards: Sequence[int]) -> None: ...

    def publish(self, records: Sequence[OutboxRecord]) -> BatchResult: ...

    def close(self) -> None: ...


class AtLeastOncePublisher:
    """One idempotent producer (acks=all) for every shard this relay owns."""

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        delivery_timeout_ms: int,
        give_up: Callable[[], bool] = lambda: False,
    ) -> None:
        self.delivery_timeout = delivery_timeout_ms / 1000
        self.give_up = give_up
        self.config = {**sending_config(kafka_config, delivery_timeout_ms), "logger": KAFKA_LOG}
        self.producer = Producer(self.config)

    def check_reachable(self, timeout: float) -> None:
        try:
            self.producer.list_topics(timeout=timeout)
        finally:
            self.serve_events()

    def serve_events(self) -> None:
        self.producer.poll(0)

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        return []

    def let_go(self, shards: Sequence[int]) -> None:
        return None

    def publish(self, records: Sequence[OutboxRecord]) -> BatchResult:
        result = BatchResult()
        try:
            produce_batch(self.producer, records, result, self.delivery_timeout, self.give_up)
        except (KafkaException, SystemError) as exc:
            error = kafka_error_of(exc)
            if error is None:
                raise
            # Cut short: rows without a report go back to pending, to be sent again.
            settled = {ack.id for ack in result.acks} | set(result.errors)
            result.not_attempted.extend(r.id for r in records if r.id not in settled)
            self._replace_if_fatal(error)
            return result
        for error in result.errors.values():
            if self._replace_if_fatal(error):
                break
        return result

    def _replace_if_fatal(self, error: KafkaError) -> bool:
        """A fatal error leaves the idempotent producer unusable: start a new one."""
        if not error.fatal():
            return False
        log.warning("the idempotent producer failed for good (%s); starting a new one", error)
        self.producer = Producer(self.config)
        return True

    def close(self) -> None:
        self.producer.flush(30)


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
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="outbox-eos")
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

    def check_reachable(self, timeout: float) -> None:
        try:
            self._consumer.list_topics(timeout=timeout)
        finally:
            self.serve_events()

    def serve_events(self) -> None:
        self._consumer.poll(0)  # assigned to nothing between take-overs: only events
        for producer in self.producers.values():
            producer.poll(0)

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        """Fence earlier owners of ``shards`` and return what their last transactions sent."""
        recovered: list[Ack] = []
        for shard in shards:
            producer = Producer(
                {
                    **sending_config(self.kafka_config, self.delivery_timeout_ms),
                    "transactional.id": f"{self.prefix}-{shard}",
                    "transaction.timeout.ms": self.transaction_timeout_ms,
                    "logger": KAFKA_LOG,
                }
            )
            producer.init_transactions(60)  # fences the old owner, ends its open transaction
            self.producers[shard] = producer
            try:
                recovered.extend(last_committed(self._consumer, self.progress_topic, shard))
            except (KafkaException, TimeoutError):
                # After a broker restart a client's metadata can stay wrong ("Unknown
                # partition" for minutes, seen in a chaos run); the next try gets a new one.
                self._consumer.close()
                self._consumer = Consumer(self._consumer_config)
                raise
        return recovered

    def let_go(self, shards: Sequence[int]) -> None:
        for shard in shards:
            producer = self.producers.pop(shard, None)
            if producer is not None:
                producer.flush(5)

    def publish(self, records: Sequence[OutboxRecord]) -> BatchResult:
        by_shard: dict[int, list[OutboxRecord]] = {}
        for record in records:
            by_shard.setdefault(record.shard, []).append(record)
        results = list(self._pool.map(lambda item: self._one_shard(*item), by_shard.items()))
        merged = BatchResult()
        for result in results:
            merged.acks.extend(result.acks)
            merged.errors.update(result.errors)
            merged.not_attempted.extend(result.not_attempted)
            merged.lost_shards.extend(result.lost_shards)
        return merged

    def _one_shard(self, shard: int, records: list[OutboxRecord]) -> BatchResult:
        """One Kafka transaction: the records and the shard's progress record, or nothing."""
        result = BatchResult()
        producer = self.producers.get(shard)
        if producer is None:
            result.not_attempted.extend(r.id for r in records)
            return result
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            return self._lost(shard, records, result, exc.args[0])
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
            return self._lost(shard, records, result, None)
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
        records: list[OutboxRecord],
        result: BatchResult,
        error: KafkaError | None,
    ) -> BatchResult:
        """This producer cannot go on: the batch is released and the shard let go."""
        if error is not None:
            log.warning("shard %d: transactional producer cannot go on: %s", shard, error)
        self.producers.pop(shard, None)
        result.acks.clear()
        result.errors.clear()
        result.not_attempted = [r.id for r in records]
        result.lost_shards.append(shard)
        return result

    def close(self) -> None:
        for producer in self.producers.values():
            producer.flush(10)
        self.producers.clear()
        self._pool.shutdown(wait=True)
        self._consumer.close()
