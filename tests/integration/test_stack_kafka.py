"""The local Kafka is a real Apache Kafka broker: idempotence, transactions, read_committed."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from outbox.devstack.topics import consume_all

pytestmark = pytest.mark.integration


def test_idempotent_producer_delivers_each_record_once_in_order(
    bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("idem")
    producer = Producer(
        {"bootstrap.servers": bootstrap_servers, "enable.idempotence": True, "acks": "all"}
    )
    acked: list[int] = []

    def on_delivery(err, msg) -> None:  # type: ignore[no-untyped-def]
        assert err is None, err
        acked.append(msg.offset())

    for i in range(200):
        producer.produce(topic, value=str(i).encode(), key=b"k", on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert acked == list(range(200))

    records = consume_all(bootstrap_servers, topic, isolation="read_committed", expect=200)
    assert [value for _, value in records] == [str(i).encode() for i in range(200)]


def test_read_committed_consumer_never_sees_aborted_records(
    bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("txn")
    producer = Producer(
        {"bootstrap.servers": bootstrap_servers, "transactional.id": f"smoke-{uuid.uuid4().hex}"}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"aborted-1")
    producer.produce(topic, value=b"aborted-2")
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"committed")
    producer.commit_transaction(30)

    committed = consume_all(bootstrap_servers, topic, isolation="read_committed", expect=1)
    everything = consume_all(bootstrap_servers, topic, isolation="read_uncommitted", expect=3)
    assert [value for _, value in committed] == [b"committed"]
    # The aborted records really reached the log; only the isolation level hides them.
    assert sorted(value for _, value in everything if value) == [
        b"aborted-1",
        b"aborted-2",
        b"committed",
    ]


def test_new_transactional_producer_fences_the_old_one(bootstrap_servers: str, make_topic) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("fence")
    transactional_id = f"smoke-{uuid.uuid4().hex}"
    config = {"bootstrap.servers": bootstrap_servers, "transactional.id": transactional_id}
    zombie = Producer(config)
    zombie.init_transactions(30)
    zombie.begin_transaction()
    zombie.produce(topic, value=b"from-zombie")
    zombie.flush(30)

    successor = Producer(config)
    successor.init_transactions(30)  # bumps the epoch and aborts the zombie's open transaction
    successor.begin_transaction()
    successor.produce(topic, value=b"from-successor")
    successor.commit_transaction(30)

    with pytest.raises(KafkaException) as caught:
        zombie.commit_transaction(30)
    assert caught.value.args[0].fatal() or caught.value.args[0].txn_requires_abort()
    records = consume_all(bootstrap_servers, topic, isolation="read_committed", expect=1)
    assert [value for _, value in records] == [b"from-successor"]


def test_topic_auto_creation_is_off(bootstrap_servers: str) -> None:
    producer = Producer({"bootstrap.servers": bootstrap_servers, "message.timeout.ms": 3000})
    errors: list[KafkaError] = []
    producer.produce(
        f"never-created-{uuid.uuid4().hex}",
        value=b"x",
        on_delivery=lambda err, _msg: errors.append(err),
    )
    producer.flush(10)
    assert len(errors) == 1
    assert errors[0].code() in {
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._MSG_TIMED_OUT,
    }
