"""Relays as real processes under failure: SIGTERM drain, kill -9 (at-least-once and
exactly-once), shard handover, and a broker outage with three relays."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.topics import consume_messages
from tests.relay_helpers import (
    message_id,
    publish_orders,
    start_relay_process,
    statuses,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration


def pending_leases(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT count(*) FROM outbox WHERE status = 'pending' AND lease_owner IS NOT NULL"
            )
        ).scalar_one()


def first_occurrences_in_key_order(records) -> bool:  # type: ignore[no-untyped-def]
    """Per key, the first copy of each message arrives in publishing order."""
    seen: set[uuid.UUID] = set()
    per_key: dict[bytes, list[int]] = defaultdict(list)
    for record in records:
        mid = message_id(record)
        if mid in seen:
            continue
        seen.add(mid)
        per_key[record.key()].append(int(record.value().decode().split(":")[1].rstrip("}")))
    return all(values == sorted(values) for values in per_key.values())


@pytest.mark.serial
def test_sigterm_finishes_the_batch_releases_and_exits_zero(
    engine, outbox_url, bootstrap_servers, make_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("drain")
    relay = start_relay_process(outbox_url, bootstrap_servers, log=tmp_path / "relay.log")
    stop_writing = threading.Event()
    written: list[uuid.UUID] = []

    def writer() -> None:
        n = 0
        while not stop_writing.is_set():
            written.extend(publish_orders(engine, topic, 100, start=n))
            n += 100

    thread = threading.Thread(target=writer)
    thread.start()
    wait_for(lambda: statuses(engine).get("sent", 0) > 500, 60, "the relay to get going")
    started = time.monotonic()
    assert stop_process(relay, signal.SIGTERM) == 0
    took = time.monotonic() - started
    stop_writing.set()
    thread.join()
    assert took < 20
    assert pending_leases(engine) == 0  # nothing left held by the stopped relay
    log = (tmp_path / "relay.log").read_text()
    assert "stopped after" in log
    # a successor finishes the rest
    successor = start_relay_process(outbox_url, bootstrap_servers)
    wait_for(lambda: set(statuses(engine)) == {"sent"}, 60, "the successor to send the rest")
    assert stop_process(successor) == 0
    records = consume_messages(bootstrap_servers, topic, expect=len(written), timeout=60)
    assert set(message_id(r) for r in records) == set(written)


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_kill_9_loses_nothing_and_exactly_once_duplicates_nothing(
    mode: str, engine, outbox_url, bootstrap_servers, make_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic(f"kill-{mode[:5]}", partitions=3)
    prefix = f"kill-{uuid.uuid4().hex[:8]}"
    args = ["--mode", mode, "--transactional-id-prefix", prefix, "--progress-topic", f"p-{prefix}"]
    ids = publish_orders(engine, topic, 4000, keys=25)
    log = tmp_path / "relay.log"
    for round_ in range(4):
        relay = start_relay_process(outbox_url, bootstrap_servers, *args, log=log)
        target = 800 * (round_ + 1)
        wait_for(lambda t=target: statuses(engine).get("sent", 0) >= t, 90, f"{target} sent")
        relay.send_signal(signal.SIGKILL)  # mid-batch, most likely
        relay.wait(10)
    survivor = start_relay_process(outbox_url, bootstrap_servers, *args, log=log)
    wait_for(lambda: statuses(engine) == {"sent": 4000}, 120, "every row sent")
    assert stop_process(survivor) == 0
    records = consume_messages(bootstrap_servers, topic, expect=4000, timeout=90)
    copies = Counter(message_id(r) for r in records)
    assert set(copies) == set(ids)  # no loss
    if mode == "exactly-once":
        assert max(copies.values()) == 1, "read_committed saw a message twice"
    assert first_occurrences_in_key_order(records)


@pytest.mark.serial
def test_a_dead_owners_shards_are_taken_over_within_seconds(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("handover")
    first = start_relay_process(outbox_url, bootstrap_servers)
    second = start_relay_process(outbox_url, bootstrap_servers)
    publish_orders(engine, topic, 200, keys=50)
    wait_for(lambda: statuses(engine) == {"sent": 200}, 60, "both relays sending")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    killed_at = time.monotonic()
    publish_orders(engine, topic, 200, keys=50, start=200)  # keys on every shard
    wait_for(lambda: statuses(engine) == {"sent": 400}, 30, "the survivor to send it all")
    assert time.monotonic() - killed_at < 15
    assert stop_process(second) == 0


def test_three_relays_ride_out_a_broker_outage_in_key_order(
    engine, outbox_url, bootstrap_servers, make_topic, kafka_broker: KafkaBroker, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("outage", partitions=3)
    log = tmp_path / "relays.log"
    relays = [
        start_relay_process(outbox_url, bootstrap_servers, "--delivery-timeout-ms", "4000", log=log)
        for _ in range(3)
    ]
    ids = publish_orders(engine, topic, 1500, keys=20)
    wait_for(lambda: statuses(engine).get("sent", 0) >= 300, 60, "relays under way")
    kafka_broker.stop()
    try:
        more = publish_orders(engine, topic, 1500, keys=20, start=1500)  # written during the outage
        time.sleep(8)  # long enough for deliveries to time out
    finally:
        kafka_broker.start()
    wait_for(lambda: statuses(engine) == {"sent": 3000}, 120, "everything sent after the outage")
    for relay in relays:
        assert stop_process(relay) == 0
    with engine.connect() as conn:
        charged = conn.execute(
            sa.text("SELECT count(*) FROM outbox WHERE attempts > 1")
        ).scalar_one()
    records = consume_messages(bootstrap_servers, topic, expect=3000, timeout=90)
    assert set(message_id(r) for r in records) == set(ids + more)
    assert first_occurrences_in_key_order(records)
    # The outage is Kafka's failure, not the messages': none is charged an attempt for it.
    assert charged == 0, f"{charged} messages charged more than one attempt for an outage"
