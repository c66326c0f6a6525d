"""Producing a batch of outbox records and waiting for Kafka's word on each: the one sending
core that the relay and the immediate sender share.

Two rules keep a key's records in order on its partition whatever happens:

* **One deadline for the whole batch, owned here.** librdkafka's own message timeout is set
  past it (:func:`sending_config`), so librdkafka never expires a message on its own. When
  the deadline passes, everything not acknowledged yet is purged at once, queued and in flight
  alike. Had librdkafka expired the messages one by one instead, the idempotent producer would
  bump its epoch after the first and could still deliver a later message of the same key:
  a gap, and the earlier message would arrive after it once retried.
* **Acknowledgements per partition come in produce order** (the idempotent producer), so what
  is acknowledged when the batch ends is a prefix of each partition's records, and what failed
  is the rest. :func:`order_gaps` checks it after every batch, as a tripwire.

After :func:`produce_batch` returns, the producer no longer retries anything of the batch.
Bytes already on the wire when it was purged may still be written by the broker: a message
that failed may be on its topic after all (a duplicate once it is sent again, as at-least-once
allows), never a gap in what was acknowledged.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from outbox.records import OutboxRecord, producer_config

#: librdkafka's message timeout lies this far past the batch deadline, so the purge at the
#: deadline always comes first.
LIBRDKAFKA_TIMEOUT_MARGIN_MS = 30_000

_PURGED = {KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT}


@dataclass(frozen=True)
class Ack:
    """Kafka stored a message: where, and which requeue generation of its row was sent."""

    id: uuid.UUID
    partition: int
    offset: int
    generation: int = 0


@dataclass
class BatchResult:
    """Per message: acknowledged, failed with a Kafka error, or not attempted (released).

    ``lost_shards`` (exactly-once) are shards whose producer cannot go on: the caller must let
    them go, so that a take-over settles their open transaction.
    """

    acks: list[Ack] = field(default_factory=list)
    errors: dict[uuid.UUID, KafkaError] = field(default_factory=dict)
    not_attempted: list[uuid.UUID] = field(default_factory=list)
    lost_shards: list[int] = field(default_factory=list)
    #: Records whose error is their own for certain: the producer refused them before
    #: sending (a local size check, a topic it does not know), not a broker refusing a
    #: request that held other records too.
    refused_alone: set[uuid.UUID] = field(default_factory=set)
    #: Exactly-once: what failed the transaction as a whole rather than one of its records
    #: (its progress record refused, say); None otherwise.
    batch_error: KafkaError | None = None


def sending_config(kafka_config: Mapping[str, Any], delivery_timeout_ms: int) -> dict[str, Any]:
    """Producer settings for :func:`produce_batch` with a batch deadline of
    ``delivery_timeout_ms``: librdkafka's own timeout is set past it."""
    return producer_config(
        {
            **kafka_config,
            "delivery.timeout.ms": delivery_timeout_ms + LIBRDKAFKA_TIMEOUT_MARGIN_MS,
        }
    )


def produce_batch(
    producer: Producer,
    records: Sequence[OutboxRecord],
    result: BatchResult,
    timeout: float,
    give_up: Callable[[], bool] = lambda: False,
    *,
    purge_in_flight: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Produce ``records`` in order and wait up to ``timeout`` seconds for every report.

    At the deadline what is not acknowledged fails with ``_TIMED_OUT`` (a retriable error);
    when ``give_up()`` turns true first (a shutdown that waited long enough) it is reported
    ``not_attempted`` instead, to be released untouched. Either way it is purged first.

    Inside a Kafka transaction pass ``purge_in_flight=False``: requests already sent are left
    to complete, as librdkafka's own abort does, and the caller aborts the transaction.
    """
    deadline = clock() + timeout
    pending = 0

    def report(record: OutboxRecord, error: KafkaError | None, message: Message) -> None:
        nonlocal pending
        pending -= 1
        partition, offset = message.partition(), message.offset()
        if error is None and partition is not None and offset is not None:
            result.acks.append(Ack(record.id, partition, offset, record.generation))
        else:
            result.errors[record.id] = error or KafkaError(KafkaError._FAIL, "no offset")

    unsent: list[OutboxRecord] = []
    for position, record in enumerate(records):
        while True:
            try:
                producer.produce(
                    record.topic,
                    value=record.value,
                    key=record.key,
                    headers=record.kafka_headers,
                    on_delivery=functools.partial(report, record),
                )
                pending += 1
                break
            except BufferError:
                if clock() >= deadline or give_up():
                    unsent = list(records[position:])  # the local queue stayed full
                    break
                producer.poll(0.05)  # the local queue is full: let deliveries drain it
            except KafkaException as exc:
                result.errors[record.id] = exc.args[0]  # refused before it was sent
                result.refused_alone.add(record.id)
                break
        if unsent:
            break
    while pending > 0 and clock() < deadline and not give_up():
        producer.flush(min(1.0, max(0.0, deadline - clock())))
    stopping = clock() < deadline  # left early: a shutdown gave up waiting
    if pending > 0:
        producer.purge(in_queue=True, in_flight=purge_in_flight)
        if purge_in_flight:
            producer.flush(5)  # runs the purged messages' reports
        else:
            producer.poll(0)  # the same; what stays in flight reports later
    purged = [rid for rid, err in result.errors.items() if err.code() in _PURGED]
    purged.extend(record.id for record in unsent)
    for record_id in purged:
        result.errors.pop(record_id, None)
        if stopping:
            result.not_attempted.append(record_id)
        else:
            result.errors[record_id] = KafkaError(
                KafkaError._TIMED_OUT, f"not acknowledged within {timeout:.0f}s"
            )


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
    if isinstance(exc, SystemError):
        # The client failed without saying why ("returned NULL without setting an
        # exception": seen when its log callback ran while it raised a fatal error, a fence).
        # Its state is unknown: the producer is done for.
        return KafkaError(KafkaError._FATAL, f"the Kafka client failed: {exc}", fatal=True)
    return None


def order_gaps(
    records: Sequence[OutboxRecord],
    result: BatchResult,
    holds_key: Callable[[KafkaError], bool],
) -> list[uuid.UUID]:
    """Acknowledged messages behind an earlier message of their key that failed with an error
    that holds the key back (``holds_key``: a retriable one; a dead message does not).

    Empty whenever the rules above hold; anything else means a key's order broke on its topic.
    """
    if not result.errors:
        return []
    acked = {ack.id for ack in result.acks}
    failed_keys: set[tuple[str, bytes]] = set()
    gaps: list[uuid.UUID] = []
    for record in sorted(records, key=lambda r: r.seq):
        if record.key is None:
            continue
        key = (record.topic, record.key)
        error = result.errors.get(record.id)
        if error is not None and holds_key(error):
            failed_keys.add(key)
        elif record.id in acked and key in failed_keys:
            gaps.append(record.id)
    return gaps
