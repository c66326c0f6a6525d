"""CloudEvents on the real stack: an outbox with a CloudEvents envelope publishes, the relay
sends, and the CloudEvents SDK (an independent consumer) parses every record the relay wrote;
the inbox deduplicates CloudEvents produced by other systems by their id; bad input is refused
before anything is written."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import sqlalchemy as sa
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings.kafka import KafkaMessage, from_binary, from_structured
from cloudevents.core.formats.json import JSONFormat
from confluent_kafka import Producer
from sqlalchemy.orm import Session

from outbox import Message, Outbox
from outbox.cloudevents import STRUCTURED_CONTENT_TYPE, CloudEvents
from outbox.devstack.topics import consume_messages
from outbox.errors import InvalidCloudEvent, InvalidHeaders
from outbox.inbox import Inbox, InboxMessage
from outbox.prepared import PreparedMessages
from outbox.schema import OutboxTableSpec
from outbox.spark_jobs.repair import requeue_missing
from tests.inbox_helpers import consumer_config, ledger, prepare_database, running_consumer
from tests.relay_helpers import message_id, relay_config, running_relay, statuses, wait_for

pytestmark = pytest.mark.integration

SOURCE = "/shop/orders"


def kafka_message(record: Any) -> KafkaMessage:
    """A consumed record as the SDK's Kafka binding takes it."""
    headers = {name: value for name, value in record.headers() or [] if value is not None}
    return KafkaMessage(headers=headers, key=record.key(), value=record.value())


def relay_everything(engine: sa.Engine, outbox_url: str, bootstrap: str, count: int) -> None:
    with running_relay(relay_config(outbox_url, bootstrap)):
        wait_for(lambda: statuses(engine) == {"sent": count}, 60, "every row sent")


def test_binary_mode_records_parse_with_the_cloudevents_sdk(
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic: Any
) -> None:
    topic = make_topic("ce-binary")
    envelope = CloudEvents(source=SOURCE, types={topic: "com.example.order.placed"})
    ob = Outbox(engine, envelope=envelope)
    before = dt.datetime.now(dt.UTC)
    with ob.transaction() as tx:
        placed = tx.publish(topic, {"id": 7, "total": 30}, key=7, subject="orders/7")
        noted, raw = tx.publish_many(
            [
                Message(topic, "a note", key=7, type="com.example.order.noted"),
                Message(topic, b"\x00\xff", key=8, headers={"tenant": "eu"}),
            ]
        )

    async def publish_async() -> uuid.UUID:
        aob = Outbox(outbox_url, envelope=envelope)
        async with aob.atransaction() as atx:
            result = await atx.publish(topic, {"id": 9}, key=9, type="com.example.order.paid")
        await aob.async_engine.dispose()
        return result.message_id

    paid = asyncio.run(publish_async())
    prepared = PreparedMessages(ob).prepare(topic, {"id": 10}, key=10, subject="orders/10")
    prepared.commit()
    after = dt.datetime.now(dt.UTC)
    relay_everything(engine, outbox_url, bootstrap_servers, 5)

    records = consume_messages(bootstrap_servers, topic, expect=5)
    events: dict[uuid.UUID, BaseCloudEvent] = {}
    for record in records:
        event = from_binary(kafka_message(record), JSONFormat())
        assert event.get_id() == str(message_id(record))  # ce_id is the outbox id
        events[message_id(record)] = event
    assert set(events) == {
        placed.message_id,
        noted.message_id,
        raw.message_id,
        paid,
        prepared.message_id,
    }
    for event in events.values():
        assert event.get_specversion() == "1.0"
        assert event.get_source() == SOURCE
        time = event.get_time()
        assert time is not None and before <= time <= after  # publish time, not send time
    expected = {
        placed.message_id: (
            "com.example.order.placed",
            "orders/7",
            "application/json",
            {"id": 7, "total": 30},
        ),
        noted.message_id: (
            "com.example.order.noted",
            None,
            "text/plain; charset=utf-8",
            "a note",
        ),
        raw.message_id: ("com.example.order.placed", None, None, b"\x00\xff"),
        paid: ("com.example.order.paid", None, "application/json", {"id": 9}),
        prepared.message_id: (
            "com.example.order.placed",
            "orders/10",
            "application/json",
            {"id": 10},
        ),
    }
    for identity, (event_type, subject, content_type, data) in expected.items():
        event = events[identity]
        assert (
            event.get_type(),
            event.get_subject(),
            event.get_datacontenttype(),
            event.get_data(),
        ) == (event_type, subject, content_type, data), identity
    assert events[placed.message_id].get_extension("partitionkey") == "7"  # the record's key
    by_id = {message_id(r): r for r in records}
    assert dict(by_id[raw.message_id].headers())["tenant"] == b"eu"


def test_structured_mode_records_parse_with_the_cloudevents_sdk(
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic: Any
) -> None:
    topic = make_topic("ce-structured")
    envelope = CloudEvents(source=SOURCE, types={topic: "com.example.order"}, mode="structured")
    ob = Outbox(engine, envelope=envelope)
    before = dt.datetime.now(dt.UTC)
    with ob.transaction() as tx:
        placed = tx.publish(topic, {"id": 7, "lines": [1, 2]}, key=7, subject="orders/7")
        raw = tx.publish(topic, b"\x00\xff", key=8, type="com.example.blob")
    after = dt.datetime.now(dt.UTC)
    relay_everything(engine, outbox_url, bootstrap_servers, 2)

    records = {message_id(r): r for r in consume_messages(bootstrap_servers, topic, expect=2)}
    assert set(records) == {placed.message_id, raw.message_id}
    for record in records.values():
        names = [name for name, _ in record.headers()]
        assert not [name for name in names if name.startswith("ce_")]
        assert dict(record.headers())["content-type"] == STRUCTURED_CONTENT_TYPE.encode()
    first = from_structured(kafka_message(records[placed.message_id]), JSONFormat())
    assert first.get_id() == str(placed.message_id)
    assert first.get_specversion() == "1.0"
    assert first.get_source() == SOURCE
    assert first.get_type() == "com.example.order"
    assert first.get_subject() == "orders/7"
    assert first.get_datacontenttype() == "application/json"
    assert first.get_data() == {"id": 7, "lines": [1, 2]}
    time = first.get_time()
    assert time is not None and before <= time <= after
    second = from_structured(kafka_message(records[raw.message_id]), JSONFormat())
    assert (second.get_id(), second.get_type()) == (str(raw.message_id), "com.example.blob")
    assert second.get_data() == b"\x00\xff"  # data_base64


def test_a_resent_message_is_the_same_event(
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic: Any
) -> None:
    """The envelope is stored with the row: a send again (here the repair of a message the
    audit found missing) produces the very same event, time included."""
    topic = make_topic("ce-resend")
    ob = Outbox(engine, envelope=CloudEvents(source=SOURCE, types={topic: "com.example.t"}))
    with ob.transaction() as tx:
        sent = tx.publish(topic, {"id": 7}, key=7)
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: statuses(engine) == {"sent": 1}, 60, "the first send")
        assert requeue_missing(engine, OutboxTableSpec(), [str(sent.message_id)]) == 1
        records = consume_messages(bootstrap_servers, topic, expect=2)
    assert len(records) == 2
    first, second = (from_binary(kafka_message(r), JSONFormat()) for r in records)
    assert first.get_id() == second.get_id() == str(sent.message_id)
    assert first.get_attributes() == second.get_attributes()
    assert records[0].value() == records[1].value()


def test_bad_input_is_refused_before_anything_is_written(engine: sa.Engine) -> None:
    envelope = CloudEvents(source=SOURCE, types={"orders": "com.example.order.placed"})
    ob = Outbox(engine, envelope=envelope)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS ce_orders (id bigint)")
    good = Message("orders", {"id": 1})
    refusals: list[tuple[Message, type[Exception]]] = [
        (Message("payments", {"id": 1}), InvalidCloudEvent),  # no type for the topic
        (Message("orders", {"id": 1}, type=""), InvalidCloudEvent),
        (Message("orders", {"id": 1}, subject=""), InvalidCloudEvent),
        (Message("orders", {"id": 1}, headers={"ce_type": "x"}), InvalidHeaders),
    ]
    for bad, error in refusals:
        # The error leaves the caller's transaction usable: it commits its own rows.
        with ob.transaction() as tx:
            tx.session.execute(sa.text("INSERT INTO ce_orders VALUES (1)"))
            with pytest.raises(error):
                tx.publish_many([good, bad])
        # Raised out of the block, it rolls the business rows back with it.
        with pytest.raises(error), ob.transaction() as tx:
            tx.session.execute(sa.text("INSERT INTO ce_orders VALUES (2)"))
            tx.publish_many([good, bad])
    plain = Outbox(engine)
    with (
        pytest.raises(InvalidCloudEvent, match="envelope"),
        Session(engine) as session,
        session.begin(),
    ):
        plain.publish(session, "orders", {"id": 1}, type="com.example.order.placed")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 0
        kept = conn.execute(sa.text("SELECT id FROM ce_orders")).scalars().all()
    assert kept == [1] * len(refusals)


@pytest.fixture
def inbox_engine(outbox_url: str) -> Iterator[sa.Engine]:
    engine = prepare_database(outbox_url)
    yield engine
    engine.dispose()


def ledger_inbox(topic: str) -> Inbox:
    """Adds a ledger row per message; a structured event's ``n`` is in its data."""
    inbox = Inbox(group=f"ce-{uuid.uuid4().hex[:8]}")

    @inbox.handler(topic)
    def on_event(message: InboxMessage, session: Session) -> None:
        value = message.value
        n = value["data"]["n"] if "specversion" in value else value["n"]
        session.execute(
            sa.text(
                "INSERT INTO ledger (message_id, topic, n, amount, kafka_partition, "
                "kafka_offset, pid) VALUES (:id, :topic, :n, :n, :partition, :offset, :pid)"
            ),
            {
                "id": message.id,
                "topic": message.topic,
                "n": n,
                "partition": message.partition,
                "offset": message.offset,
                "pid": os.getpid(),
            },
        )

    return inbox


def test_the_inbox_deduplicates_cloudevents_of_other_systems_by_their_id(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic: Any
) -> None:
    topic = make_topic("ce-inbox")
    uuid_id = uuid.uuid4()

    def binary(n: int, source: bytes, event_id: bytes) -> tuple[bytes, list[tuple[str, bytes]]]:
        headers = [
            ("ce_specversion", b"1.0"),
            ("ce_id", event_id),
            ("ce_source", source),
            ("ce_type", b"com.example.invoice"),
            ("content-type", b"application/json"),
        ]
        return orjson.dumps({"n": n}), headers

    def structured(n: int, event_id: str) -> tuple[bytes, list[tuple[str, bytes]]]:
        event = {"specversion": "1.0", "id": event_id, "source": "/erp", "type": "t"}
        value = orjson.dumps({**event, "datacontenttype": "application/json", "data": {"n": n}})
        return value, [("content-type", STRUCTURED_CONTENT_TYPE.encode())]

    # Every record twice (a producer's retry), none with an outbox-id header. Two sources use
    # the id "1": different events, each applied once.
    records = [
        binary(1, b"/billing", b"1"),
        binary(2, b"/shipping", b"1"),
        binary(3, b"/billing", str(uuid_id).encode()),
        structured(4, "A-1"),
    ]
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    for value, headers in records + records:
        producer.produce(topic, value, key=b"k", headers=headers)
    assert producer.flush(30) == 0

    with running_consumer(ledger_inbox(topic), consumer_config(outbox_url, bootstrap_servers)) as (
        runner
    ):
        wait_for(lambda: runner.metrics.duplicates.labels(topic)._value.get() == 4, 60, "dups")
    applied = {(row.message_id, row.n) for row in ledger(inbox_engine)}
    assert applied == {("/billing 1", 1), ("/shipping 1", 2), (str(uuid_id), 3), ("/erp A-1", 4)}
    assert len(ledger(inbox_engine)) == 4
    with inbox_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM inbox_parked")).scalar_one() == 0
