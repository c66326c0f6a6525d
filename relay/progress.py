"""Exactly-once progress records: what each shard's last committed Kafka transaction held.

Every exactly-once batch of a shard is one Kafka transaction holding the data records *and*
one progress record on the progress topic (partition = shard), listing each message id with
the partition and offset it got. A new owner of the shard first fences the old producer
(``init_transactions``), then reads the shard's last committed progress records (the newest
one, and every other one among the partition's last ``RECOVERY_OFFSETS`` offsets) and marks
those rows sent: a crash between "Kafka committed" and "rows marked sent" never republishes
them, nor do marks of the last batches lost in a failover to an asynchronous standby.
Marking a row from any committed record is right: its Kafka transaction committed, and a
record vouches only for the generation of the row it sent.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from outbox.schema import SHARD_COUNT
from outbox.sending import Ack

#: How many of a shard's last progress offsets a take-over reads (a batch takes two: its
#: record and its transaction's commit marker); further back, doubling each time, only until
#: one committed record is found.
RECOVERY_OFFSETS = 64
#: The most messages of one exactly-once transaction: its progress record lists each (about
#: 60 bytes apiece), and must stay well under the broker's default record limit (1 MB).
PROGRESS_ACKS = 8000


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
    """The acks of ``shard``'s last committed progress records (see :func:`last_committed_of`)."""
    return last_committed_of(consumer, topic, [shard], timeout).get(shard, [])


def last_committed_of(
    consumer: Consumer, topic: str, shards: Sequence[int], timeout: float = 15.0
) -> dict[int, list[Ack]]:
    """The acks of the last committed progress records of each of ``shards`` (a shard with
    none is left out): every record among a shard's last ``RECOVERY_OFFSETS`` offsets, or,
    with none there, among twice as many, and so on. Read side by side: one by one, a
    take-over of eight shards read for ten seconds, each waiting for its partition's end.

    ``consumer`` must be ``read_committed``; call this after ``init_transactions`` of the
    shards' producers, so no transaction of an earlier owner is still open.
    """
    ends = {shard: _watermarks(consumer, TopicPartition(topic, shard), timeout) for shard in shards}
    found: dict[int, list[Ack]] = {}
    lookback = RECOVERY_OFFSETS
    looking = {shard: max(low, high - lookback) for shard, (low, high) in ends.items()}
    while looking:
        newest = _committed_between(consumer, topic, looking, ends, timeout)
        found.update((shard, acks) for shard, acks in newest.items())
        lookback *= 2
        # A shard with no record in its last offsets (aborted transactions' markers) looks
        # further back, down to its first offset.
        looking = {
            shard: max(ends[shard][0], ends[shard][1] - lookback)
            for shard, start in looking.items()
            if shard not in newest and start > ends[shard][0]
        }
    return found


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


def _committed_between(
    consumer: Consumer,
    topic: str,
    starts: dict[int, int],
    ends: dict[int, tuple[int, int]],
    timeout: float,
) -> dict[int, list[Ack]]:
    """The acks of each shard's progress records from ``starts`` to its end (each shard with
    at least one), all read at once."""
    open_shards = {shard for shard, start in starts.items() if start < ends[shard][1]}
    if not open_shards:
        return {}
    consumer.assign([TopicPartition(topic, shard, starts[shard]) for shard in open_shards])
    newest: dict[int, list[Ack]] = {}
    try:
        while open_shards:
            message = consumer.poll(timeout)
            if message is None:
                raise TimeoutError(
                    f"no progress records from {topic}{sorted(open_shards)} in {timeout}s"
                )
            shard = message.partition()
            assert shard is not None  # a partition's message or end
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    open_shards.discard(shard)
                    continue
                raise KafkaException(error)
            value = message.value()
            if value is not None:
                newest.setdefault(shard, []).extend(decode_progress(value))
            offset = message.offset()
            if offset is not None and offset >= ends[shard][1] - 1:
                open_shards.discard(shard)
    finally:
        consumer.unassign()
    return newest
