"""Exactly-once publishing when Kafka stops answering at commit, and after repair: a timed-out
commit is resumed, a commit that never answers gives the shard up for a take-over to settle,
and a row requeued by repair is never marked sent by the progress record of its earlier send."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from outbox import ID_HEADER, Message, Outbox
from outbox.chaos.proxy import FaultProxy
from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.topics import consume_messages
from outbox.records import OutboxRecord
from outbox.relay.producers import ExactlyOncePublisher, Outcome
from outbox.relay.progress import ensure_progress_topic
from outbox.relay.store import RelayStore
from outbox.schema import DEFAULT_SPEC, shard_of
from outbox.spark_jobs.repair import requeue_missing
from tests.relay_helpers import message_id

pytestmark = pytest.mark.integration


def records(topic: str, count: int, shard: int = 0) -> list[OutboxRecord]:
    made = []
    for n in range(count):
        record_id = uuid.uuid4()
        headers: list[tuple[str, bytes | None]] = [(ID_HEADER, str(record_id).encode())]
        made.append(OutboxRecord(record_id, n, shard, topic, b"k", b"%d" % n, headers))
    return made


@pytest.fixture
def publishers(kafka_broker: KafkaBroker) -> Iterator[object]:
    """Makes exactly-once publishers sharing one transactional-id prefix; closes them after."""
    prefix = f"eos-{uuid.uuid4().hex[:8]}"
    progress = f"p-{prefix}"
    ensure_progress_topic(
        AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers}), progress
    )
    made: list[ExactlyOncePublisher] = []

    def make(
        bootstrap: str, owner: str = "relay-a", delivery_timeout_ms: int = 10_000
    ) -> ExactlyOncePublisher:
        publisher = ExactlyOncePublisher(
            {"bootstrap.servers": bootstrap},
            transactional_id_prefix=prefix,
            progress_topic=progress,
            owner=owner,
            delivery_timeout_ms=delivery_timeout_ms,
        )
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close()


def stall_at_transaction_end(
    publisher: ExactlyOncePublisher, proxy: FaultProxy, heal_after: float | None
) -> None:
    """Stall the network just as the publisher ends its next transaction."""
    finish = publisher._finish

    def stalled(producer: object, commit: bool, expires: float) -> Outcome:
        proxy.stall()
        if heal_after is not None:
            threading.Timer(heal_after, proxy.heal).start()
        publisher._finish = finish  # type: ignore[method-assign]
        return finish(producer, commit, expires)  # type: ignore[arg-type]

    publisher._finish = stalled  # type: ignore[method-assign]


def test_a_commit_that_timed_out_is_resumed_and_the_shard_goes_on(
    publishers, faulty_kafka: FaultProxy, kafka_broker: KafkaBroker, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("resume")
    publisher = publishers(f"127.0.0.1:{faulty_kafka.listen_port}")
    publisher.finish_call_timeout = 2.0
    publisher.take_over([0])
    batch = records(topic, 30)
    assert len(publisher.publish(batch[:10]).acks) == 10
    stall_at_transaction_end(publisher, faulty_kafka, heal_after=3.0)
    stalled = publisher.publish(batch[10:20])
    # The first commit_transaction timed out; calling it again after the heal completed it.
    assert len(stalled.acks) == 10 and not stalled.lost_shards and not stalled.not_attempted
    after = publisher.publish(batch[20:])
    assert len(after.acks) == 10, "the producer is stuck after a resumable commit timeout"
    seen = consume_messages(kafka_broker.bootstrap_servers, topic, expect=30)
    assert sorted(message_id(r) for r in seen) == sorted(r.id for r in batch)


def test_a_commit_that_never_answers_gives_the_shard_up_and_a_take_over_settles_it(
    publishers, faulty_kafka: FaultProxy, kafka_broker: KafkaBroker, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("settle")
    publisher = publishers(f"127.0.0.1:{faulty_kafka.listen_port}", delivery_timeout_ms=1000)
    publisher.finish_call_timeout = 1.0
    publisher.take_over([0])
    batch = records(topic, 10)
    stall_at_transaction_end(publisher, faulty_kafka, heal_after=None)
    result = publisher.publish(batch)
    assert result.lost_shards == [0]
    assert not result.acks and sorted(result.not_attempted) == sorted(r.id for r in batch)
    assert 0 not in publisher.producers
    faulty_kafka.heal()
    # The next owner (here the same relay again) settles the open transaction and learns from
    # the progress record whether it committed: all of the batch or none of it.
    recovered = {ack.id for ack in publisher.take_over([0])}
    assert recovered in (set(), {r.id for r in batch})
    rest = [r for r in batch if r.id not in recovered]
    if rest:
        assert len(publisher.publish(rest).acks) == len(rest)
    seen = consume_messages(kafka_broker.bootstrap_servers, topic, expect=10)
    assert sorted(message_id(r) for r in seen) == sorted(r.id for r in batch)


def test_a_row_requeued_by_repair_is_sent_again_not_marked_sent_by_the_old_progress(
    engine: sa.Engine, publishers, bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("requeue")
    with Outbox(engine).transaction() as tx:
        ids = [
            r.message_id
            for r in tx.publish_many([Message(topic, {"n": n}, key="k") for n in range(20)])
        ]
    shard = shard_of(b"k", ids[0])
    first = RelayStore(engine, DEFAULT_SPEC, "relay-first")
    old_owner = publishers(bootstrap_servers, owner="relay-first")
    old_owner.take_over([shard])
    leased = first.read_batch([shard], 100)
    result = old_owner.publish([leased_row.record for leased_row in leased])
    first.record_outcome(result.acks, [])
    first.close()
    assert len(result.acks) == 20

    # The audit found one message missing on its topic (say, lost by the broker); repair puts
    # it back to pending. Before it is sent again, another relay takes the shard over.
    lost = ids[3]
    assert requeue_missing(engine, DEFAULT_SPEC, [str(lost)]) == 1
    second = RelayStore(engine, DEFAULT_SPEC, "relay-second")
    new_owner = publishers(bootstrap_servers, owner="relay-second")
    recovered = new_owner.take_over([shard])
    assert lost in {ack.id for ack in recovered}  # the last progress record lists it
    assert second.mark_committed(recovered) == 0
    with engine.connect() as conn:
        status, generation = conn.execute(
            sa.text("SELECT status, generation FROM outbox WHERE id = :id"), {"id": lost}
        ).one()
    assert (status, generation) == ("pending", 1)

    again = second.read_batch([shard], 100)
    assert [row.id for row in again] == [lost]
    resent = new_owner.publish([row.record for row in again])
    second.record_outcome(resent.acks, [])
    second.close()
    assert [ack.generation for ack in resent.acks] == [1]
    copies = consume_messages(bootstrap_servers, topic, expect=21)
    assert sum(1 for r in copies if message_id(r) == lost) == 2


def test_a_progress_reader_with_stale_metadata_is_replaced_so_the_next_take_over_works(
    kafka_broker: KafkaBroker,
) -> None:
    """The state a chaos run once met after a broker restart: the reader's metadata lacks the
    shard's partition, and it answers "Unknown partition" until its next metadata refresh
    (five minutes by default). Made on demand here: the reader learns the progress topic
    while it has one partition, then the topic grows. Without replacing the reader after a
    failed take-over, every later take-over of the shard fails the same way."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import NewPartitions, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers})
    prefix = f"eos-{uuid.uuid4().hex[:8]}"
    progress = f"p-{prefix}"
    admin.create_topics([NewTopic(progress, num_partitions=1, replication_factor=1)])[
        progress
    ].result(30)
    publisher = ExactlyOncePublisher(
        {"bootstrap.servers": kafka_broker.bootstrap_servers},
        transactional_id_prefix=prefix,
        progress_topic=progress,
        owner="relay-a",
        delivery_timeout_ms=10_000,
    )
    try:
        assert publisher.take_over([0]) == []  # the reader now knows one partition
        admin.create_partitions([NewPartitions(progress, 16)])[progress].result(30)
        with pytest.raises(KafkaException, match="Unknown partition"):
            publisher.take_over([5])
        assert publisher.take_over([5]) == []  # a fresh reader sees all 16
    finally:
        publisher.close()


def test_marks_lost_with_the_last_batches_are_recovered_from_their_progress_records(
    engine: sa.Engine, publishers, bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
    """A failover to an asynchronous standby loses the marks of the last commits before it.
    A take-over that read only the newest progress record marked the last batch alone: the
    batches before it were sent again. Every record among the shard's last offsets counts."""
    topic = make_topic("lostmarks")
    with Outbox(engine).transaction() as tx:
        ids = [
            r.message_id
            for r in tx.publish_many([Message(topic, {"n": n}, key="k") for n in range(30)])
        ]
    shard = shard_of(b"k", ids[0])
    first = RelayStore(engine, DEFAULT_SPEC, "relay-first")
    old_owner = publishers(bootstrap_servers, owner="relay-first")
    old_owner.take_over([shard])
    for _ in range(3):  # three batches, three Kafka transactions, three progress records
        batch = first.read_batch([shard], 10)
        result = old_owner.publish([row.record for row in batch])
        first.record_outcome(result.acks, [])
        assert len(result.acks) == 10
    first.close()
    # The standby the database failed over to never saw the three marks.
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = 'pending', sent_at = NULL, kafka_partition = NULL,"
                " kafka_offset = NULL WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        )
    second = RelayStore(engine, DEFAULT_SPEC, "relay-second")
    new_owner = publishers(bootstrap_servers, owner="relay-second")
    recovered = new_owner.take_over([shard])
    assert second.mark_committed(recovered) == 30
    assert second.read_batch([shard], 100) == []  # nothing left to send again
    second.close()
