"""Letting go of shards while Kafka is out of reach: a relay asked to stop while its batches
wait for a broker it cannot reach lets its shards go and returns within a few seconds of its
shutdown timeout, and its health endpoint answers meanwhile. Real PostgreSQL and Kafka; the
relay reaches the broker through a fault proxy that drops it."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from outbox.chaos.proxy import FaultProxy
from tests.relay_helpers import publish_orders, relay_config, statuses
from tests.relay_outside import mode_options, wait_until, watched

pytestmark = pytest.mark.integration

SHUTDOWN_TIMEOUT = 4.0
#: Beyond the shutdown timeout, for letting the shards go and closing.
STOP_MARGIN = 4.0


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_a_relay_stopped_while_kafka_is_out_of_reach_stops_in_time(  # type: ignore[no-untyped-def]
    engine: sa.Engine, outbox_url: str, faulty_kafka: FaultProxy, make_topic, mode: str
) -> None:
    topic = make_topic("outage-stop", partitions=3)
    config = relay_config(
        outbox_url,
        f"127.0.0.1:{faulty_kafka.listen_port}",
        metrics_port=0,
        delivery_timeout_ms=30_000,
        shutdown_timeout=SHUTDOWN_TIMEOUT,
        **mode_options(mode, "outage-stop"),
    )
    with watched(config) as relay:
        publish_orders(engine, topic, 100, keys=30)
        wait_until(lambda: statuses(engine) == {"sent": 100}, 60, "the relay sending")
        faulty_kafka.drop()
        publish_orders(engine, topic, 300, keys=30, start=100)  # batches for every shard
        time.sleep(2.0)  # on their way to a broker out of reach
        answers: list[float] = []

        def ask_health() -> None:
            while relay.running:
                began = time.monotonic()
                try:
                    relay.get("/healthz", timeout=10)
                except OSError:
                    return  # the endpoint closes when run() ends
                answers.append(time.monotonic() - began)
                time.sleep(0.2)

        asking = threading.Thread(target=ask_health, daemon=True)
        asking.start()
        took = relay.stop(timeout=120)
        asking.join(15)
        faulty_kafka.heal()
    assert took <= SHUTDOWN_TIMEOUT + STOP_MARGIN, f"stopped {took:.1f}s after stop()"
    assert answers and max(answers) < 2.0, f"/healthz answered in up to {max(answers):.1f}s"
    assert statuses(engine).get("sent") == 100  # the rest stays pending, for the next owner
