"""Exactly-once sending when Kafka stops answering at commit, and after repair: a timed-out
commit is resumed, a commit that never answers gives the shard up for a take-over to settle,
and a row requeued by repair is never marked sent by the progress record of its earlier send."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from outbox import ID_HEADER, Message, Outbox
from outbox.chaos.proxy import FaultProxy
from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.topics import consume_messages
from outbox.records import OutboxRecord
from outbox.relay import transactions
from outbox.relay.progress import ensure_progress_topic
from outbox.relay.store import RelayStore
from outbox.relay.transactions import ExactlyOnceSender
from outbox.schema import DEFAULT_SPEC, shard_of
from outbox.spark_jobs.repair import requeue_missing
from tests.relay_helpers import message_id, send_and_wait

pytestmark = pytest.mark.integration

MakeSender = Callable[..., ExactlyOnceSender]


def records(topic: str, count: int, shard: int = 0) -> list[OutboxRecord]:
    made = []
    for n in range(count):
        record_id = uuid.uuid4()
        headers: list[tuple[str, bytes | None]] = [(ID_HEADER, str(record_id).encode())]
        made.append(OutboxRecord(record_id, n, shard, topic, b"k", b"%d" % n, headers))
    return made


class CommitStall:
    """Stalls the network (``proxy``) as the next transaction's commit begins, and heals it
    ``heal_after`` seconds later (never: None); counts the commit calls made since."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.armed = False
        self.heal_after: float | None = None
        self.calls = 0

    def arm(self, heal_after: float | None) -> None:
        self.armed, self.heal_after, self.calls = True, heal_after, 0

    def producer(self, config: dict[str, Any]) -> Producer:
        stall = self

        class Stalling(Producer):
            def commit_transaction(self, *timeout: float) -> None:
                stall.calls += 1
                if stall.armed:
                    stall.armed = False
                    stall.proxy.stall()
                    if stall.heal_after is not None:
                        threading.Timer(stall.heal_after, stall.proxy.heal).start()
                super().commit_transaction(*timeout)

        return Stalling(config)


@pytest.fixture
def senders(kafka_broker: KafkaBroker) -> Iterator[MakeSender]:
    """Makes exactly-once senders sharing one transactional-id prefix; closes them after."""
    prefix = f"eos-{uuid.uuid4().hex[:8]}"
    progress = f"p-{prefix}"
    ensure_progress_topic(
        AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers}), progress
    )
    made: list[ExactlyOnceSender] = []

    def make(
        bootstrap: str, owner: str = "relay-a", delivery_timeout_ms: int = 10_000, **more: Any
    ) -> ExactlyOnceSender:
        sender = ExactlyOnceSender(
            {"bootstrap.servers": bootstrap},
            transactional_id_prefix=prefix,
            progress_topic=progress,
            owner=owner,
            delivery_timeout_ms=delivery_timeout_ms,
            **more,
        )
        made.append(sender)
        return sender

    yield make
    for sender in made:
        sender.close()


def test_a_commit_that_timed_out_is_resumed_and_the_shard_goes_on(
    senders: MakeSender,
    faulty_kafka: FaultProxy,
    kafka_broker: KafkaBroker,
    make_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transactions, "INIT_TIMEOUT", 2.0)
    topic = make_topic("resume")
    stall = CommitStall(faulty_kafka)
    sender = senders(f"127.0.0.1:{faulty_kafka.listen_port}", producer_factory=stall.producer)
    assert sender.take_over([0]) == {}
    batch = records(topic, 30)
    assert len(send_and_wait(sender, batch[:10]).acks) == 10
    stall.arm(heal_after=3.0)
    stalled = send_and_wait(sender, batch[10:20])
    # The first commit_transaction timed out; calling it again after the heal completed it.
    assert stall.calls >= 2, "the commit did not time out: nothing was resumed"
    assert len(stalled.acks) == 10 and not stalled.lost_shards and not stalled.not_attempted
    after = send_and_wait(sender, batch[20:])
    assert len(after.acks) == 10, "the producer is stuck after a resumable commit timeout"
    seen = consume_messages(kafka_broker.bootstrap_servers, topic, expect=30)
    assert sorted(message_id(r) for r in seen) == sorted(r.id for r in batch)


def test_a_commit_that_never_answers_gives_the_shard_up_and_a_take_over_settles_it(
    senders: MakeSender,
    faulty_kafka: FaultProxy,
    kafka_broker: KafkaBroker,
    make_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = make_topic("settle")
    stall = CommitStall(faulty_kafka)
    sender = senders(
        f"127.0.0.1:{faulty_kafka.listen_port}",
        delivery_timeout_ms=1000,
        producer_factory=stall.producer,
    )
    assert sender.take_over([0]) == {}  # (a fresh coordinator may take seconds to load)
    # The commit is tried again every second until the transaction's own timeout (31 s).
    init_timeout = transactions.INIT_TIMEOUT
    monkeypatch.setattr(transactions, "INIT_TIMEOUT", 1.0)
    batch = records(topic, 10)
    stall.arm(heal_after=None)
    result = send_and_wait(sender, batch)
    assert result.lost_shards == [0]
    assert not result.acks and sorted(result.not_attempted) == sorted(r.id for r in batch)
    # The shard was given up: a batch of it is not even tried until it is taken over again.
    untried = send_and_wait(sender, batch)
    assert not untried.acks and sorted(untried.not_attempted) == sorted(r.id for r in batch)
    faulty_kafka.heal()
    # The next owner (here the same sender again) settles the open transaction and learns
    # from the progress record whether it committed: all of the batch or none of it. Its
    # take-over waits as a relay's does: the coordinator may still be ending the stalled
    # transaction (CONCURRENT_TRANSACTIONS until then).
    monkeypatch.setattr(transactions, "INIT_TIMEOUT", init_timeout)
    recovered = {ack.id for ack in sender.take_over([0]).get(0, [])}
    assert recovered in (set(), {r.id for r in batch})
    rest = [r for r in batch if r.id not in recovered]
    if rest:
        assert len(send_and_wait(sender, rest).acks) == len(rest)
    seen = consume_messages(kafka_broker.bootstrap_servers, topic, expect=10)
    assert sorted(message_id(r) for r in seen) == sorted(r.id for r in batch)


def test_a_row_requeued_by_repair_is_sent_again_not_marked_sent_by_the_old_progress(
    engine: sa.Engine, senders: MakeSender, bootstrap_servers: str, make_topic: Callable[..., str]
) -> None:
    topic = make_topic("requeue")
    with Outbox(engine).transaction() as tx:
        ids = [
            r.message_id
            for r in tx.publish_many([Message(topic, {"n": n}, key="k") for n in range(20)])
        ]
    shard = shard_of(b"k", ids[0])
    first = RelayStore(engine, DEFAULT_SPEC, "relay-first")
    old_owner = senders(bootstrap_servers, owner="relay-first")
    assert old_owner.take_over([shard]) == {}
    leased = first.read_batch([shard], 100)
    result = send_and_wait(old_owner, [row.record for row in leased if row.record])
    first.record_outcome(result.acks, [])
    first.close()
    assert len(result.acks) == 20

    # The audit found one message missing on its topic (say, lost by the broker); repair puts
    # it back to pending. Before it is sent again, another relay takes the shard over.
    lost = ids[3]
    assert requeue_missing(engine, DEFAULT_SPEC, [str(lost)]) == 1
    second = RelayStore(engine, DEFAULT_SPEC, "relay-second")
    new_owner = senders(bootstrap_servers, owner="relay-second")
    recovered = new_owner.take_over([shard]).get(shard, [])
    assert lost in {ack.id for ack in recovered}  # the last progress record lists it
    assert second.mark_committed(recovered) == 0
    with engine.connect() as conn:
        status, generation = conn.execute(
            sa.text("SELECT status, generation FROM outbox WHERE id = :id"), {"id": lost}
        ).one()
    assert (status, generation) == ("pending", 1)

    again = second.read_batch([shard], 100)
    assert [row.id for row in again] == [lost]
    resent = send_and_wait(new_owner, [row.record for row in again if row.record])
    second.record_outcome(resent.acks, [])
    second.close()
    assert [ack.generation for ack in resent.acks] == [1]
    with engine.connect() as conn:
        status = conn.execute(
            sa.text("SELECT status FROM outbox WHERE id = :id"), {"id": lost}
        ).scalar_one()
    assert status == "sent"
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
    sender = ExactlyOnceSender(
        {"bootstrap.servers": kafka_broker.bootstrap_servers},
        transactional_id_prefix=prefix,
        progress_topic=progress,
        owner="relay-a",
        delivery_timeout_ms=10_000,
    )
    try:
        assert sender.take_over([0]) == {}  # the reader now knows one partition
        admin.create_partitions([NewPartitions(progress, 16)])[progress].result(30)
        with pytest.raises(KafkaException, match="Unknown partition"):
            sender.take_over([5])
        assert sender.take_over([5]) == {}  # a fresh reader sees all 16
    finally:
        sender.close()


def test_marks_lost_with_the_last_batches_are_recovered_from_their_progress_records(
    engine: sa.Engine, senders: MakeSender, bootstrap_servers: str, make_topic: Callable[..., str]
) -> None:
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
    old_owner = senders(bootstrap_servers, owner="relay-first")
    assert old_owner.take_over([shard]) == {}
    for _ in range(3):  # three batches, three Kafka transactions, three progress records
        batch = first.read_batch([shard], 10)
        result = send_and_wait(old_owner, [row.record for row in batch if row.record])
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
    new_owner = senders(bootstrap_servers, owner="relay-second")
    recovered = new_owner.take_over([shard]).get(shard, [])
    assert second.mark_committed(recovered) == 30
    assert second.read_batch([shard], 100) == []  # nothing left to send again
    second.close()
