"""The idempotent producer failing for good (a fatal librdkafka error) beside a relay's
shutdown: ``run()`` returns 0. A fatal error on purpose: ``enable.gapless.guarantee=true``
(a Kafka client setting the relay lets through) makes librdkafka fail the producer for good
when a batch fails in a way that could leave a gap, such as an in-flight purge (the relay's
own, at a deadline or when a shutdown gives up) or a record batch the broker refuses. Real
PostgreSQL and Kafka; the relay reaches the broker through a fault proxy that slows it, so
that its batches are on the wire when it stops."""

from __future__ import annotations

import os
import time

import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.chaos.proxy import FaultProxy
from tests.relay_helpers import publish_orders, relay_config, statuses
from tests.relay_outside import WatchedRelay, wait_until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("poison", [False, True], ids=["purged-in-flight", "refused-batch"])
def test_a_relay_whose_producer_fails_for_good_while_stopping_returns_zero(  # type: ignore[no-untyped-def]
    engine: sa.Engine,
    outbox_url: str,
    faulty_kafka: FaultProxy,
    make_topic,
    poison: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = make_topic("fatal-producer", config={"max.message.bytes": "20000"})
    config = relay_config(
        outbox_url,
        f"127.0.0.1:{faulty_kafka.listen_port}",
        kafka={"enable.gapless.guarantee": True},
        shutdown_timeout=1.0,
    )
    relay = WatchedRelay(config)
    relay.thread.start()
    try:
        publish_orders(engine, topic, 20)
        wait_until(lambda: statuses(engine) == {"sent": 20}, 60, "the relay sending")
        faulty_kafka.set_latency(1000)  # a request takes 2 s: the stop finds them on the wire
        if poison:
            with Outbox(engine).transaction() as tx:
                tx.publish_many([Message(topic, os.urandom(60_000), key="k")])
        publish_orders(engine, topic, 50, start=20)
        time.sleep(0.3)  # on the wire
        took = relay.stop(timeout=60)
    finally:
        faulty_kafka.heal()
        relay.stop()
    # librdkafka's own line: the producer failed for good (the case this test is about).
    assert any("gap-less" in record.getMessage().lower() for record in caplog.records)
    assert relay.raised is None and relay.returned == 0, relay.ended_because()
    assert took < 10, f"stopped {took:.1f}s after stop()"
    assert statuses(engine).get("sent", 0) >= 20  # (the rest stays pending, or was sent)
