"""Per-key order on the real servers: a key backing off holds back only itself, writers of one
key get the order their transactions make visible, and a batch that runs out of time fails as a
whole per partition (no later message of a key acknowledged after an earlier one failed)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict

import pytest
import sqlalchemy as sa
from confluent_kafka import KafkaError

from outbox import ID_HEADER, Message, Outbox
from outbox.chaos.proxy import FaultProxy
from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.topics import consume_messages
from outbox.records import OutboxRecord
from outbox.relay.policy import RETRIABLE, classify
from outbox.relay.sender import AtLeastOnceSender
from outbox.relay.store import RelayStore
from outbox.schema import DEFAULT_SPEC, SHARD_COUNT, shard_of
from outbox.sending import order_gaps
from tests.relay_helpers import (
    message_id,
    relay_config,
    running_relay,
    send_and_wait,
    statuses,
    wait_for,
)

pytestmark = pytest.mark.integration


def keys_in_shard(shard: int, count: int) -> list[str]:
    found = []
    n = 0
    while len(found) < count:
        key = f"key-{n}"
        if shard_of(key.encode(), uuid.uuid4()) == shard:
            found.append(key)
        n += 1
    return found


def publish(engine: sa.Engine, topic: str, key: str, count: int) -> list[uuid.UUID]:
    with Outbox(engine).transaction() as tx:
        results = tx.publish_many([Message(topic, {"n": n}, key=key) for n in range(count)])
    return [r.message_id for r in results]


def test_a_key_backing_off_with_a_deep_backlog_does_not_hold_back_its_shard(
    engine: sa.Engine,
) -> None:
    blocked, other, third = keys_in_shard(5, 3)
    behind = publish(engine, "orders", blocked, 300)  # more than the relay's lease window
    others = publish(engine, "orders", other, 20) + publish(engine, "orders", third, 20)
    with engine.begin() as conn:  # the key's first message failed and waits for its retry
        conn.execute(
            sa.text(
                "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour'"
                " WHERE id = :id"
            ),
            {"id": behind[0]},
        )
    store = RelayStore(engine, DEFAULT_SPEC, "relay-test")
    leased = store.read_batch(list(range(SHARD_COUNT)), 1000)
    assert sorted(row.id for row in leased) == sorted(others)
    # Once the retry is due, the key goes on in order from its first message.
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET next_attempt_at = now() WHERE id = :id"), {"id": behind[0]}
        )
    again = store.read_batch(list(range(SHARD_COUNT)), 1000)
    store.close()
    of_blocked = [row.id for row in again if row.id in set(behind)]
    assert of_blocked and of_blocked == behind[: len(of_blocked)]


def test_a_key_written_by_two_open_transactions_goes_out_in_the_order_they_commit(
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
    """The documented promise: the relay sends a key's committed messages in seq order, and a
    message becomes visible only when its transaction commits. Two writers of one key that do
    not serialize get the order of their commits, whatever their seq."""
    topic = make_topic("interleave")
    ob = Outbox(engine)
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        with engine.connect() as first, engine.connect() as second:
            first.begin()
            early = ob.publish(first, topic, {"who": "first"}, key="k").message_id
            second.begin()
            late = ob.publish(second, topic, {"who": "second"}, key="k").message_id
            second.commit()
            wait_for(lambda: statuses(engine).get("sent") == 1, 30, "the second commit sent")
            first.commit()
        wait_for(lambda: statuses(engine) == {"sent": 2}, 30, "both sent")
    with engine.connect() as conn:
        seqs = dict(conn.execute(sa.text("SELECT id, seq FROM outbox")).all())
    assert seqs[early] < seqs[late]
    order = [message_id(r) for r in consume_messages(bootstrap_servers, topic, expect=2)]
    assert order == [late, early]


def test_writers_that_lock_the_business_row_get_their_messages_in_seq_order(
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
    """The documented recipe: lock the business row first (SELECT ... FOR UPDATE, or UPDATE
    it), then publish. The second writer waits for the first to commit, so seq order, commit
    order and the order on the topic agree."""
    topic = make_topic("serialized")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE accounts (id int PRIMARY KEY, balance int)"))
        conn.execute(sa.text("INSERT INTO accounts VALUES (1, 0)"))
    ob = Outbox(engine)
    ids: list[uuid.UUID] = []
    first_locked = threading.Event()

    def write(who: str, hold: float) -> None:
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT balance FROM accounts WHERE id = 1 FOR UPDATE"))
            first_locked.set()
            ids.append(ob.publish(conn, topic, {"who": who}, key="account-1").message_id)
            time.sleep(hold)

    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        first = threading.Thread(target=write, args=("first", 1.0))
        first.start()
        first_locked.wait(10)
        second = threading.Thread(target=write, args=("second", 0.0))
        second.start()
        first.join(30)
        second.join(30)
        wait_for(lambda: statuses(engine) == {"sent": 2}, 30, "both sent")
    with engine.connect() as conn:
        seqs = dict(conn.execute(sa.text("SELECT id, seq FROM outbox")).all())
    assert seqs[ids[0]] < seqs[ids[1]]
    assert [message_id(r) for r in consume_messages(bootstrap_servers, topic, expect=2)] == ids


def records(topic: str, count: int, keys: int) -> list[OutboxRecord]:
    made = []
    for n in range(count):
        record_id = uuid.uuid4()
        headers: list[tuple[str, bytes | None]] = [(ID_HEADER, str(record_id).encode())]
        key = b"key-%d" % (n % keys)
        made.append(OutboxRecord(record_id, n, 0, topic, key, b"%d" % n, headers))
    return made


def test_a_batch_that_runs_out_of_time_leaves_nothing_in_flight_and_no_gap(
    faulty_kafka: FaultProxy, kafka_broker: KafkaBroker, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("deadline", partitions=3)
    sender = AtLeastOnceSender({"bootstrap.servers": f"127.0.0.1:{faulty_kafka.listen_port}"}, 3000)
    try:
        assert len(send_and_wait(sender, records(topic, 20, keys=4)).acks) == 20  # connected
        faulty_kafka.stall()
        batch = records(topic, 200, keys=4)
        result = send_and_wait(sender, batch)
        # Nothing acknowledged, nothing left in flight: each record failed retriably (its
        # deadline) or, the gap-less producer replaced at the purge, was given back unsent.
        assert not result.acks and sender.in_flight == 0
        assert set(result.errors) | set(result.not_attempted) == {r.id for r in batch}
        assert {e.code() for e in result.errors.values()} <= {KafkaError._TIMED_OUT}
        assert all(classify(e) == RETRIABLE for e in result.errors.values())
        faulty_kafka.heal()
        # Latency that lets part of a batch through before the deadline: what was
        # acknowledged is, per partition, what came first.
        faulty_kafka.set_latency(700)
        slow = records(topic, 3000, keys=6)
        partial = send_and_wait(sender, slow)
        faulty_kafka.heal()
        assert order_gaps(slow, partial, lambda e: classify(e) == RETRIABLE) == []
        answered = {a.id for a in partial.acks} | set(partial.errors) | set(partial.not_attempted)
        assert answered == {r.id for r in slow}
        assert sender.in_flight == 0
        assert len(send_and_wait(sender, records(topic, 20, keys=4)).acks) == 20  # still usable
        by_partition: dict[int, list[int]] = defaultdict(list)
        for ack in partial.acks:
            by_partition[ack.partition].append(ack.offset)
        for offsets in by_partition.values():
            assert sorted(offsets) == list(range(min(offsets), min(offsets) + len(offsets)))
    finally:
        sender.close()


def test_two_batches_in_flight_are_purged_at_the_first_deadline_even_while_the_loop_is_busy(
    faulty_kafka: FaultProxy, kafka_broker: KafkaBroker, make_topic
) -> None:  # type: ignore[no-untyped-def]
    """With the loop stuck elsewhere (a slow database statement, say) past a batch's deadline,
    the deadline still purges the producer at once: librdkafka never times messages out one by
    one, and the batch started later ends with the first."""
    from outbox.flights import IdempotentSender

    topic = make_topic("watchdog", partitions=3)
    sender = IdempotentSender({"bootstrap.servers": f"127.0.0.1:{faulty_kafka.listen_port}"}, 2000)
    try:
        assert len(sender.publish(records(topic, 10, keys=2)).acks) == 10  # connected
        faulty_kafka.drop()
        first = sender.start(records(topic, 50, keys=5))
        time.sleep(0.5)
        second = sender.start(records(topic, 50, keys=5))
        time.sleep(2.5)  # the loop is busy elsewhere; nobody calls wait()
        faulty_kafka.heal()
        time.sleep(3)  # had nothing purged them, the producer would deliver them now
        on_topic = consume_messages(
            kafka_broker.bootstrap_servers,
            topic,
            expect=10,
            timeout=5,
            isolation="read_uncommitted",
        )
        assert len(on_topic) == 10
        ended = sender.wait(0)
        assert set(ended) == {first, second}
        for flight in (first, second):
            assert not flight.result.acks
            assert {e.code() for e in flight.result.errors.values()} == {KafkaError._TIMED_OUT}
    finally:
        faulty_kafka.heal()
        sender.close(5)


@pytest.mark.parametrize("attempt", range(3))
def test_a_deadline_that_passes_while_a_batch_is_being_produced_leaves_no_gap(
    faulty_kafka: FaultProxy, make_topic, attempt: int
) -> None:  # type: ignore[no-untyped-def]
    """The deadline's purge runs on a thread of its own. Had it run between two produce calls
    of one batch (a loop that resumed from a stalled database statement right at a deadline,
    say), the records produced before it would fail and the ones after it be acknowledged:
    later messages of a key on the topic before earlier ones."""
    from outbox.flights import IdempotentSender

    topic = make_topic(f"purge-mid-batch-{attempt}", partitions=3)
    sender = IdempotentSender(
        {"bootstrap.servers": f"127.0.0.1:{faulty_kafka.listen_port}"}, 30_000
    )
    try:
        assert len(sender.publish(records(topic, 10, keys=2)).acks) == 10  # connected
        faulty_kafka.set_latency(200)  # nothing is acknowledged while the batch is produced
        batch = records(topic, 30_000, keys=6)
        # The deadline passes a few milliseconds into producing the batch.
        flight = sender.start(batch, timeout=0.005)
        while not flight.done():
            sender.wait(1.0)
        assert flight.result.errors, "the deadline ended the batch before all of it was acked"
        assert order_gaps(batch, flight.result, lambda error: True) == []
    finally:
        faulty_kafka.heal()
        sender.close(5)
