"""The relay on real PostgreSQL and Kafka: delivery, headers, offsets, poison, undecodable
rows, per-key order behind a retry, exactly-once, metrics."""

from __future__ import annotations

import os
import urllib.request
import uuid
from collections import defaultdict

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

from outbox import Outbox
from outbox.devstack.topics import consume_messages
from outbox.schema import OutboxTableSpec
from tests.relay_helpers import (
    message_id,
    publish_orders,
    relay_config,
    running_relay,
    send_and_wait,
    statuses,
    wait_for,
)

pytestmark = pytest.mark.integration


def sent_offsets(engine: sa.Engine) -> dict[uuid.UUID, tuple[int, int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, kafka_partition, kafka_offset FROM outbox WHERE status = 'sent'")
        )
        return {row.id: (row.kafka_partition, row.kafka_offset) for row in rows}


def test_all_messages_delivered_with_headers_and_recorded_offsets(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("relay", partitions=3)
    ids = publish_orders(engine, topic, 1000)
    with running_relay(relay_config(outbox_url, bootstrap_servers, metrics_port=0)) as relay:
        wait_for(lambda: statuses(engine) == {"sent": 1000}, 60, "every row sent")
        metrics = (
            urllib.request.urlopen(
                f"http://127.0.0.1:{relay.metrics_server_port}/metrics", timeout=5
            )
            .read()
            .decode()
        )
        ready = urllib.request.urlopen(
            f"http://127.0.0.1:{relay.metrics_server_port}/readyz", timeout=5
        ).status
    assert f'outbox_relay_published_total{{topic="{topic}"}} 1000.0' in metrics
    assert "outbox_relay_owned_shards 16.0" in metrics
    assert ready == 200
    records = consume_messages(bootstrap_servers, topic, expect=1000)
    assert sorted(message_id(r) for r in records) == sorted(ids)
    offsets = sent_offsets(engine)
    assert all(offsets[message_id(r)] == (r.partition(), r.offset()) for r in records)
    headers = dict(records[0].headers())
    assert headers["content-type"] == b"application/json"
    # each key's messages arrive in publishing order
    seen: dict[bytes, list[int]] = defaultdict(list)
    for record in records:
        seen[record.key()].append(int(record.value().decode().split(":")[1].rstrip("}")))
    assert all(values == sorted(values) for values in seen.values())


def test_poison_messages_are_dead_lettered_while_neighbours_flow(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("poison")
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    small = f"small-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(small, 1, 1, config={"max.message.bytes": "2000"})])[
        small
    ].result(30)
    wait_for(lambda: small in admin.list_topics(timeout=5).topics, 10, "the small topic")
    ob = Outbox(engine)
    with ob.transaction() as tx:
        good_before = tx.publish(topic, b"before", key="k").message_id
        # random bytes: compression must not shrink it under the topic's limit
        too_large = tx.publish(small, os.urandom(10_000), key="k").message_id
        no_topic = tx.publish(f"missing-{uuid.uuid4().hex[:8]}", b"lost?", key="k").message_id
        good_after = tx.publish(topic, b"after", key="k").message_id
    with engine.begin() as conn:  # a row corrupted by hand: header arrays that do not pair up
        undecodable = publish_orders(engine, topic, 1)[0]
        conn.execute(
            sa.text(
                "UPDATE outbox SET header_names = '{a,b}', header_values = '{}' WHERE id = :id"
            ),
            {"id": undecodable},
        )
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: statuses(engine) == {"sent": 2, "dead": 3}, 60, "poison dead, rest sent")
    with engine.connect() as conn:
        dead = {
            row.id: row.error_kind
            for row in conn.execute(
                sa.text("SELECT id, error_kind FROM outbox WHERE status = 'dead'")
            )
        }
    assert dead == {
        too_large: "message_too_large",
        no_topic: "unknown_topic",
        undecodable: "undecodable",
    }
    values = [r.value() for r in consume_messages(bootstrap_servers, topic, expect=2)]
    assert values == [b"before", b"after"]  # the small topic's limit learned before it sent
    assert {good_before, good_after} <= set(sent_offsets(engine))
    admin.delete_topics([small])


def test_a_message_backing_off_holds_back_only_its_own_key(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("backoff")
    ob = Outbox(engine)
    with ob.transaction() as tx:
        first = tx.publish(topic, b"a-1", key="a").message_id
        tx.publish(topic, b"a-2", key="a")
        tx.publish(topic, b"b-1", key="b")
    with engine.begin() as conn:  # as if the first attempt of a-1 had failed
        conn.execute(
            sa.text(
                "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '3 seconds', "
                "error_kind = 'retriable' WHERE id = :id"
            ),
            {"id": first},
        )
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: statuses(engine).get("sent") == 1, 20, "key b sent")
        assert statuses(engine) == {"sent": 1, "pending": 2}  # a-2 waits behind a-1
        wait_for(lambda: statuses(engine) == {"sent": 3}, 30, "key a sent after the backoff")
    values = [r.value() for r in consume_messages(bootstrap_servers, topic, expect=3)]
    assert values == [b"b-1", b"a-1", b"a-2"]


def test_exactly_once_mode_delivers_each_message_once_to_read_committed(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("eos", partitions=3)
    ids = publish_orders(engine, topic, 600)
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    config = relay_config(
        outbox_url,
        bootstrap_servers,
        mode="exactly-once",
        transactional_id_prefix=prefix,
        progress_topic=f"progress-{prefix}",
    )
    with running_relay(config):
        wait_for(lambda: statuses(engine) == {"sent": 600}, 90, "every row sent")
    records = consume_messages(bootstrap_servers, topic, expect=600)
    assert sorted(message_id(r) for r in records) == sorted(ids)
    progress = consume_messages(bootstrap_servers, f"progress-{prefix}", expect=1)
    assert progress, "each committed batch leaves a progress record"


def test_crash_between_kafka_commit_and_marking_never_republishes(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    from outbox.relay.progress import ensure_progress_topic
    from outbox.relay.store import RelayStore
    from outbox.relay.transactions import ExactlyOnceSender

    topic = make_topic("eos-gap")
    prefix = f"gap-{uuid.uuid4().hex[:8]}"
    progress = f"progress-{prefix}"
    ensure_progress_topic(AdminClient({"bootstrap.servers": bootstrap_servers}), progress)
    ids = publish_orders(engine, topic, 50, keys=1)  # one key: one shard
    store = RelayStore(engine, OutboxTableSpec(), "relay-crashed")
    publisher = ExactlyOnceSender(
        {"bootstrap.servers": bootstrap_servers},
        transactional_id_prefix=prefix,
        progress_topic=progress,
        owner="relay-crashed",
        delivery_timeout_ms=10_000,
    )
    shards = list(range(16))
    publisher.take_over(shards)
    batch = store.read_batch(shards, 50)
    result = send_and_wait(publisher, [leased.record for leased in batch if leased.record])
    assert len(result.acks) == 50  # committed in Kafka ...
    publisher.close()  # ... and the relay dies before marking the rows sent
    store.close()
    assert statuses(engine) == {"pending": 50}

    config = relay_config(
        outbox_url,
        bootstrap_servers,
        mode="exactly-once",
        transactional_id_prefix=prefix,
        progress_topic=progress,
    )
    with running_relay(config):
        wait_for(lambda: statuses(engine) == {"sent": 50}, 60, "the rows marked sent")
    records = consume_messages(bootstrap_servers, topic, expect=50)
    assert sorted(message_id(r) for r in records) == sorted(ids)  # once each, not twice
    offsets = sent_offsets(engine)
    assert all(offsets[message_id(r)] == (r.partition(), r.offset()) for r in records)


def test_keep_nothing_mode_deletes_rows_once_kafka_has_them(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("nothing")
    ids = publish_orders(engine, topic, 300)
    with running_relay(relay_config(outbox_url, bootstrap_servers, delete_on_send=True)):
        wait_for(lambda: statuses(engine) == {}, 60, "every row deleted")
    records = consume_messages(bootstrap_servers, topic, expect=300)
    assert sorted(message_id(r) for r in records) == sorted(ids)
