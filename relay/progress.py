"""Exactly-once progress records: what each shard's last committed Kafka transaction held.

Every exactly-once batch of a shard is one Kafka transaction holding the data records *and*
one progress record on the progress topic (partition = shard), listing each message id with
the partition and offset it got. A new owner of the shard first fences the old producer
(``init_transactions``), then reads the newest committed progress record and marks those rows
sent: a crash between "Kafka committed" and "rows marked sent" never republishes them.
"""

from __future__ import annotations

import time
import uuid

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from outbox.schema import SHARD_COUNT
from outbox.sending import Ack

#: How far back to look for the newest committed progress record, doubling each time.
_FIRST_LOOKBACK = 16


def encode_progress(shard: int, owner: str, acks: list[Ack]) -> bytes:
    return orjson.dumps(
        {
            "shard": shard,
            "owner": owner,
            # The generation says which requeue of the row this batch sent (see
            # `requeue_missing`): recovery marks a row sent only for that same generation.
            # orjson writes a UUID as its text itself, several times faster than str().
            "acks": [[a.id, a.partition, a.offset, a.generation] for a in acks],
        }
    )


def decode_progress(value: bytes) -> list[Ack]:
    body = orjson.loads(value)
    # Records written before generations existed list three fields: generation 0.
    return [
        Ack(
            uuid.UUID(entry[0]),
            int(entry[1]),
            int(entry[2]),
            int(entry[3]) if len(entry) > 3 else 0,
        )
        for entry in body["acks"]
    ]


def ensure_progress_topic(admin: AdminClient, topic: str, replication_factor: int = -1) -> None:
    """Create the progress topic (one partition per shard, compacted) unless it exists."""
    if topic in admin.list_topics(timeout=15).topics:
        return
    new = NewTopic(
        topic,
        num_partitions=SHARD_COUNT,
        replication_factor=replication_factor,
        config={"cleanup.policy": "compact"},
    )
    try:
        admin.create_topics([new], operation_timeout=30)[topic].result(30)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:  # another relay was first
            raise
    # A new topic's partitions take a moment to get leaders; reading them before fails.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        described = admin.list_topics(topic, timeout=10).topics.get(topic)
        if (
            described
            and described.partitions
            and all(p.leader >= 0 for p in described.partitions.values())
        ):
            return
        time.sleep(0.2)


def last_committed(consumer: Consumer, topic: str, shard: int, timeout: float = 15.0) -> list[Ack]:
    """The acks of the newest committed progress record of ``shard`` (empty if none).

    ``consumer`` must be ``read_committed``; call this after ``init_transactions`` of the
    shard's producer, so no transaction of an earlier owner is still open.
    """
    low, high = _watermarks(consumer, TopicPartition(topic, shard), timeout)
    lookback = _FIRST_LOOKBACK
    while True:
        start = max(low, high - lookback)
        found = _newest_between(consumer, topic, shard, start, high, timeout)
        if found is not None or start == low:
            return found or []
        lookback *= 2


def _watermarks(consumer: Consumer, partition: TopicPartition, timeout: float) -> tuple[int, int]:
    """The partition's offsets; a leader still settling in (a new topic) is waited for."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            low, high = consumer.get_watermark_offsets(partition, timeout=timeout)
            return int(low), int(high)
        except KafkaException as exc:
            if not exc.args[0].retriable() and exc.args[0].code() not in _SETTLING:
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


_SETTLING = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE}


def _newest_between(
    consumer: Consumer, topic: str, shard: int, start: int, end: int, timeout: float
) -> list[Ack] | None:
    if start >= end:
        return None
    consumer.assign([TopicPartition(topic, shard, start)])
    newest: list[Ack] | None = None
    try:
        while True:
            message = consumer.poll(timeout)
            if message is None:
                raise TimeoutError(f"no progress records from {topic}[{shard}] in {timeout}s")
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    return newest
                raise KafkaException(error)
            value = message.value()
            if value is not None:
                newest = decode_progress(value)
            offset = message.offset()
            if offset is not None and offset >= end - 1:
                return newest
    finally:
        consumer.unassign()
