"""An outage of Kafka while an exactly-once relay takes its shards over: once Kafka is back
the rows flow within :data:`AFTER_RETURN_BOUND` seconds, not after the take-over's whole wait
for its transactional producers (60 s). Real PostgreSQL and Kafka; the relay reaches the
broker through a fault proxy that slows its path (so that the take-over takes seconds) and
then drops it while the take-over's producers are connecting."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from outbox.chaos.proxy import FaultProxy
from tests.relay_helpers import publish_orders, relay_config, statuses
from tests.relay_outside import mode_options, wait_until, watched

pytestmark = pytest.mark.integration

OUTAGE_SECONDS = 5.0
#: Measured 16-18 s (librdkafka reconnects after its backoff, up to 10 s, then the take-over
#: ends): well under the 60 s the take-over may wait for its producers.
AFTER_RETURN_BOUND = 30.0


def test_an_outage_during_an_exactly_once_take_over_costs_no_long_wait(  # type: ignore[no-untyped-def]
    engine: sa.Engine, outbox_url: str, faulty_kafka: FaultProxy, make_topic
) -> None:
    topic = make_topic("outage-take-over", partitions=3)
    publish_orders(engine, topic, 100, keys=30)
    config = relay_config(
        outbox_url,
        f"127.0.0.1:{faulty_kafka.listen_port}",
        delivery_timeout_ms=4000,
        **mode_options("exactly-once", "outage-take-over"),
    )
    faulty_kafka.set_latency(300)  # every request takes 0.6 s or more: the take-over, seconds
    before = faulty_kafka.accepted
    with watched(config) as relay:
        # A take-over makes a transactional producer per shard, each with its connections.
        wait_until(lambda: faulty_kafka.accepted - before >= 8, 60, "the take-over connecting")
        faulty_kafka.drop()
        time.sleep(OUTAGE_SECONDS)
        faulty_kafka.heal()
        took = wait_until(
            lambda: statuses(engine) == {"sent": 100}, 90, "the rows sent after the outage"
        )
        relay.assert_running()
    assert took <= AFTER_RETURN_BOUND, f"the rows were sent {took:.1f}s after Kafka returned"
