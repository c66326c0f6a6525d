"""Producing a leased batch to Kafka, at-least-once or exactly-once."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer

from outbox.records import OutboxRecord, producer_config
from relay.progress import encode_progress, last_committed
from relay.store import Ack

log = logging.getLogger(__name__)


#: How much longer than the delivery timeout a Kafka transaction may stay open.
TRANSACTION_MARGIN_MS = 30_000
#: The broker's default transaction.max.timeout.ms: no transaction may be longer.
MAX_TRANSACTION_MS = 900_000

_PURGED = {KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT}


@dataclass
class BatchResult:
    """Per message: acknowledged, failed with a Kafka error, or not attempted (released)."""

    acks: list[Ack] = field(default_factory=list)
    errors: dict[uuid.UUID, KafkaError] = field(default_factory=dict)
    not_attempted: list[uuid.UUID] = field(default_factory=list)
    fenced: list[int] = field(default_factory=list)


class BatchPublisher(Protocol):
    def take_over(self, shards: Sequence[int]) -> list[Ack]: ...

    def let_go(self, shards: Sequence[int]) -> None: ...

    def publish(self, records: Sequence[OutboxRecord]) -> BatchResult: ...

    def close(self) -> None: ...


def _produce_all(
    producer: Producer,
    records: Sequence[OutboxRecord],
    result: BatchResult,
    timeout: float,
    give_up: Callable[[], bool] = lambda: False,
) -> None:
    """Produce ``records`` in order and wait for every delivery report.

    When ``give_up()`` turns true (a shutdown that waited long enough), what Kafka has not
    acknowledged yet is purged: those rows are released untouched, for the next owner.
    """
    pending = 0

    def report(record_id: uuid.UUID, error: KafkaError | None, message: Message) -> None:
        nonlocal pending
        pending -= 1
        partition, offset = message.partition(), message.offset()
        if error is None and partition is not None and offset is not None:
            result.acks.append(Ack(record_id, partition, offset))
        else:
            result.errors[record_id] = error or KafkaError(KafkaError._FAIL, "no offset")

    for record in records:
        while True:
            try:
                producer.produce(
                    record.topic,
                    value=record.value,
                    key=record.key,
                    headers=record.kafka_headers,
                    on_delivery=functools.partial(report, record.id),
                )
                pending += 1
                break
            except BufferError:
                producer.poll(0.05)  # the local queue is full: let deliveries drain it
            except KafkaException as exc:
                result.errors[record.id] = exc.args[0]
                break
    deadline = time.monotonic() + timeout
    while pending > 0 and time.monotonic() < deadline:
        producer.flush(min(1.0, max(0.0, deadline - time.monotonic())))
        if pending > 0 and give_up():
            producer.purge(in_queue=True, in_flight=True)
            producer.flush(5)
            break
    purged = [rid for rid, err in result.errors.items() if err.code() in _PURGED]
    for record_id in purged:
        del result.errors[record_id]
        result.not_attempted.append(record_id)


def kafka_error_of(exc: BaseException) -> KafkaError | None:
    """The KafkaError behind ``exc``, or None.

    A fatal producer error (fenced, say) is raised from inside ``flush()``; when a delivery
    report runs after it, confluent-kafka reports a SystemError caused by the KafkaException.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KafkaException):
            error: KafkaError = seen.args[0]
            return error
        seen = seen.__cause__ or seen.__context__
    return None


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
        self.config = producer_config({**kafka_config, "delivery.timeout.ms": delivery_timeout_ms})
        self.producer = Producer(self.config)

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        return []

    def let_go(self, shards: Sequence[int]) -> None:
        return None

    def publish(self, records: Sequence[OutboxRecord]) -> BatchResult:
        result = BatchResult()
        try:
            _produce_all(self.producer, records, result, self.delivery_timeout + 10, self.give_up)
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


class ExactlyOncePublisher:
    """One transactional producer per owned shard; each batch is one Kafka transaction.

    ``transactional.id`` is ``<prefix>-<shard>``: the next owner of a shard fences the last.
    """

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
        }
        self._consumer = Consumer(self._consumer_config)

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        """Fence earlier owners of ``shards`` and return what their last transactions sent."""
        recovered: list[Ack] = []
        for shard in shards:
            producer = Producer(
                producer_config(
                    {
                        **self.kafka_config,
                        "transactional.id": f"{self.prefix}-{shard}",
                        "transaction.timeout.ms": self.transaction_timeout_ms,
                        "delivery.timeout.ms": self.delivery_timeout_ms,
                    }
                )
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
            merged.fenced.extend(result.fenced)
        return merged

    def _one_shard(self, shard: int, records: list[OutboxRecord]) -> BatchResult:
        result = BatchResult()
        producer = self.producers.get(shard)
        if producer is None:
            result.not_attempted.extend(r.id for r in records)
            return result
        try:
            producer.begin_transaction()
            _produce_all(
                producer, records, result, self.delivery_timeout_ms / 1000 + 10, self.give_up
            )
            if result.errors or result.not_attempted or len(result.acks) != len(records):
                producer.abort_transaction(30)
                failed = set(result.errors)
                result.not_attempted = [r.id for r in records if r.id not in failed]
                result.acks.clear()
                return result
            producer.produce(
                self.progress_topic,
                key=str(shard).encode(),
                value=encode_progress(shard, self.owner, result.acks),
                partition=shard,
            )
            producer.commit_transaction(60)
        except (KafkaException, SystemError) as exc:
            found = kafka_error_of(exc)
            if found is None:
                raise
            error = found
            result.acks.clear()
            result.errors.clear()
            result.not_attempted = [r.id for r in records]
            if error.fatal() or error.code() in {
                KafkaError._FENCED,
                KafkaError.PRODUCER_FENCED,
                KafkaError.INVALID_PRODUCER_EPOCH,
            }:
                # Another relay owns the shard now; this producer is dead for good.
                self.producers.pop(shard, None)
                result.fenced.append(shard)
            elif error.txn_requires_abort():
                try:
                    producer.abort_transaction(30)
                except KafkaException:
                    self.producers.pop(shard, None)
                    result.fenced.append(shard)
            log.warning("exactly-once batch of shard %d not committed: %s", shard, error)
        return result

    def close(self) -> None:
        for producer in self.producers.values():
            producer.flush(10)
        self.producers.clear()
        self._pool.shutdown(wait=True)
        self._consumer.close()
