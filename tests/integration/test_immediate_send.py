"""QMQ-style immediate send on real PostgreSQL and Kafka: it never races the relay into
duplicates, never overtakes an earlier message of the same key, and loses nothing on failure."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import sqlalchemy as sa

from devstack.topics import consume_messages
from outbox import ID_HEADER, Message, Outbox
from outbox.immediate import ImmediateSender
from outbox.queries import Queries
from outbox.schema import DEFAULT_SPEC

pytestmark = pytest.mark.integration


def rows(engine: sa.Engine) -> dict[uuid.UUID, sa.RowMapping]:
    with engine.connect() as conn:
        result = conn.execute(
            sa.text(
                "SELECT id, status, kafka_partition, kafka_offset, lease_owner, attempts "
                "FROM outbox ORDER BY seq"
            )
        )
        return {row["id"]: row for row in result.mappings()}


def publish(engine: sa.Engine, topic: str, count: int, key: str | None = None) -> list[uuid.UUID]:
    ob = Outbox(engine)
    with ob.transaction() as tx:
        results = tx.publish_many([Message(topic, {"n": i}, key=key) for i in range(count)])
    return [r.message_id for r in results]


@pytest.fixture
def sender(engine: sa.Engine, bootstrap_servers: str):  # type: ignore[no-untyped-def]
    made: list[ImmediateSender] = []

    def make(**options):  # type: ignore[no-untyped-def]
        config = {"bootstrap.servers": bootstrap_servers, **options.pop("kafka", {})}
        instance = ImmediateSender(engine, config, **options)
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.close(10)


def test_committed_messages_are_sent_and_marked_with_their_offsets(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("imm", partitions=2)
    immediate = sender()
    ob = Outbox(engine, immediate=immediate)
    with ob.transaction() as tx:
        sent = [tx.publish(topic, {"n": i}, key=f"k{i % 4}").message_id for i in range(20)]
    with pytest.raises(RuntimeError), ob.transaction() as tx:
        tx.publish(topic, b"rolled back")
        raise RuntimeError
    assert immediate.flush(30)

    stored = rows(engine)
    assert {r["status"] for r in stored.values()} == {"sent"}
    records = consume_messages(bootstrap_servers, topic, expect=20)
    assert len(records) == 20
    by_id = {uuid.UUID(dict(m.headers())[ID_HEADER].decode()): m for m in records}
    assert set(by_id) == set(sent)
    for message_id, message in by_id.items():
        assert (stored[message_id]["kafka_partition"], stored[message_id]["kafka_offset"]) == (
            message.partition(),
            message.offset(),
        )


def test_two_senders_racing_on_the_same_rows_send_each_once(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("race")
    ids = publish(engine, topic, 200)
    first, second = sender(), sender()  # stand-ins for the writer and the relay
    outcomes = []
    barrier = threading.Barrier(2)

    def run(instance: ImmediateSender) -> None:
        barrier.wait()
        outcomes.append(instance.send_now(ids))

    threads = [threading.Thread(target=run, args=(s,)) for s in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sent = [i for outcome in outcomes for i in outcome.sent]
    assert sorted(sent) == sorted(ids)  # every row sent, by exactly one of them
    records = consume_messages(bootstrap_servers, topic, expect=200)
    assert len(records) == 200
    assert {r["status"] for r in rows(engine).values()} == {"sent"}


def test_a_message_never_overtakes_an_earlier_one_of_its_key(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("order")
    first_id, second_id = publish(engine, topic, 2, key="same")
    queries = Queries(DEFAULT_SPEC)
    with engine.begin() as conn:  # the relay holds the first message
        conn.execute(
            queries["lease_ids"], {"ids": [first_id], "owner": "relay-1", "lease_seconds": 60}
        )
    outcome = sender().send_now([second_id])
    assert outcome.sent == []
    assert outcome.left_to_relay == [second_id]
    stored = rows(engine)
    assert stored[second_id]["status"] == "pending"
    assert stored[second_id]["lease_owner"] is None  # released at once for the relay
    assert consume_messages(bootstrap_servers, topic, expect=0, timeout=3) == []


def test_a_crashed_senders_rows_stay_pending_and_go_once_its_lease_ends(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("crash")
    ids = publish(engine, topic, 3)
    with engine.begin() as conn:  # leased, then the process died before producing
        conn.execute(
            Queries(DEFAULT_SPEC)["lease_ids"],
            {"ids": ids, "owner": "dead-process", "lease_seconds": 2},
        )
    survivor = sender()
    assert survivor.send_now(ids).sent == []  # the lease still holds
    assert {r["status"] for r in rows(engine).values()} == {"pending"}
    time.sleep(2.5)
    assert sorted(survivor.send_now(ids).sent) == sorted(ids)
    assert len(consume_messages(bootstrap_servers, topic, expect=3)) == 3


def test_unreachable_broker_leaves_rows_pending_and_unleased(engine, sender) -> None:  # type: ignore[no-untyped-def]
    from devstack.procs import free_port

    ids = publish(engine, "orders", 2)
    immediate = sender(
        kafka={"bootstrap.servers": f"127.0.0.1:{free_port()}", "delivery.timeout.ms": 1500},
        lease_seconds=5,
    )
    outcome = immediate.send_now(ids)
    assert outcome.sent == []
    assert set(outcome.failed) == set(ids)
    stored = rows(engine)
    assert {r["status"] for r in stored.values()} == {"pending"}
    assert {r["lease_owner"] for r in stored.values()} == {None}


def test_keep_nothing_mode_deletes_rows_once_acknowledged(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("nothing")
    ids = publish(engine, topic, 5)
    outcome = sender(delete_on_send=True).send_now(ids)
    assert sorted(outcome.sent) == sorted(ids)
    assert rows(engine) == {}
    assert len(consume_messages(bootstrap_servers, topic, expect=5)) == 5


def test_rows_released_after_a_send_ran_out_of_time_are_no_longer_retried_by_the_sender(
    engine, kafka_broker, faulty_kafka, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    """The sender waits its whole delivery timeout (here longer than 20 s), then purges what
    Kafka has not acknowledged before it gives the rows back: when the broker comes back,
    none of them is sent from this producer behind the relay's back."""
    topic = make_topic("timeout")
    ids = publish(engine, topic, 5)
    faulty_kafka.drop()  # the broker cannot be reached at all
    immediate = sender(
        kafka={
            "bootstrap.servers": f"127.0.0.1:{faulty_kafka.listen_port}",
            "delivery.timeout.ms": 25_000,
        },
        lease_seconds=40,
    )
    started = time.monotonic()
    outcome = immediate.send_now(ids)
    assert time.monotonic() - started >= 24
    assert outcome.sent == [] and set(outcome.failed) == set(ids)
    assert {(r["status"], r["lease_owner"]) for r in rows(engine).values()} == {("pending", None)}
    faulty_kafka.heal()
    late = consume_messages(
        kafka_broker.bootstrap_servers, topic, expect=0, timeout=6, isolation="read_uncommitted"
    )
    assert late == []


def test_a_message_behind_a_deep_backlog_of_its_shard_is_left_to_the_relay(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    """The order check reads at most ORDER_CHECK_REACH earlier rows of a shard; behind a deeper
    backlog the relay is behind anyway, and sends the message in order."""
    from outbox.immediate import ORDER_CHECK_REACH
    from outbox.schema import shard_of

    topic = make_topic("backlog")
    key = "behind"
    shard = shard_of(key.encode(), uuid.uuid4())
    others = [f"o{n}" for n in range(5000) if shard_of(f"o{n}".encode(), uuid.uuid4()) == shard]
    with Outbox(engine).transaction() as tx:
        tx.publish_many(
            [
                Message(topic, {"n": n}, key=others[n % len(others)])
                for n in range(ORDER_CHECK_REACH + 50)
            ]
        )
    (newest,) = publish(engine, topic, 1, key=key)
    outcome = sender().send_now([newest])
    assert outcome.sent == [] and outcome.left_to_relay == [newest]
    assert rows(engine)[newest]["lease_owner"] is None


def test_a_failed_immediate_send_logs_why(engine, sender, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    ids = publish(engine, "no-such-topic-here", 2)
    immediate = sender()
    with caplog.at_level(logging.WARNING, logger="outbox.immediate"):
        assert immediate.submit(ids)
        assert immediate.flush(30)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "outbox.immediate"]
    assert "2 of 2 messages failed" in line and "Unknown topic" in line, line
    assert {r["status"] for r in rows(engine).values()} == {"pending"}
