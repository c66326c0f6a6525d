"""A batch's deadline ends only batches that are still waiting for Kafka: one acknowledged
in full whose reports were not served yet (the loop was busy elsewhere) purges nothing at its
deadline, so the batches after it are not failed, nor their messages charged an attempt. Real
broker behind the fault proxy."""

from __future__ import annotations

import time

import pytest

from outbox.chaos.proxy import FaultProxy
from outbox.flights import IdempotentSender
from tests.integration.test_relay_order import records

pytestmark = pytest.mark.integration


def test_an_acknowledged_batch_not_yet_served_purges_nothing_at_its_deadline(
    faulty_kafka: FaultProxy, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("acked-unserved", partitions=3)
    sender = IdempotentSender(
        {"bootstrap.servers": f"127.0.0.1:{faulty_kafka.listen_port}"}, 30_000
    )
    try:
        assert len(sender.publish(records(topic, 10, keys=2)).acks) == 10  # connected
        first = sender.start(records(topic, 20, keys=4), timeout=1.0)
        time.sleep(0.5)  # the broker acknowledges it; nobody serves the reports (no wait())
        faulty_kafka.stall()
        second = sender.start(records(topic, 20, keys=4))  # its own deadline: 30 s
        time.sleep(1.0)  # the first batch's deadline passes, the loop still busy elsewhere
        faulty_kafka.heal()
        deadline = time.monotonic() + 20
        while not second.done() and time.monotonic() < deadline:
            sender.wait(0.5)
        assert len(first.result.acks) == 20 and not first.result.errors
        assert len(second.result.acks) == 20, second.result.errors
        assert not second.result.errors and not second.result.not_attempted
    finally:
        faulty_kafka.heal()
        sender.close(5)
