"""An outage of Kafka longer than the delivery timeout: what was pending is sent within
:data:`AFTER_RETURN_BOUND` seconds of Kafka's return, and no message is charged more than one
attempt for it (an outage is Kafka's failure, not the message's: none nears ``dead`` for it).
Real PostgreSQL and Kafka; the relay reaches the broker through a fault proxy that drops it."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from outbox.chaos.proxy import FaultProxy
from outbox.relay.policy import RetryPolicy
from tests.relay_helpers import publish_orders, relay_config, statuses
from tests.relay_outside import mode_options, wait_until, watched

pytestmark = pytest.mark.integration

DELIVERY_TIMEOUT_MS = 4000
#: Five delivery timeouts.
OUTAGE_SECONDS = 20.0
AFTER_RETURN_BOUND = 10.0


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_an_outage_longer_than_the_delivery_timeout_ages_no_message(  # type: ignore[no-untyped-def]
    engine: sa.Engine, outbox_url: str, faulty_kafka: FaultProxy, make_topic, mode: str
) -> None:
    topic = make_topic("outage-aging", partitions=3)
    config = relay_config(
        outbox_url,
        f"127.0.0.1:{faulty_kafka.listen_port}",
        delivery_timeout_ms=DELIVERY_TIMEOUT_MS,
        retry=RetryPolicy(),  # the defaults: 12 attempts, backoff from 0.5 s up to 300 s
        **mode_options(mode, "outage-aging"),
    )
    with watched(config) as relay:
        publish_orders(engine, topic, 100, keys=30)
        wait_until(lambda: statuses(engine) == {"sent": 100}, 60, "the relay sending")
        faulty_kafka.drop()
        publish_orders(engine, topic, 500, keys=30, start=100)
        time.sleep(OUTAGE_SECONDS)
        faulty_kafka.heal()
        took = wait_until(
            lambda: statuses(engine) == {"sent": 600}, 60, "every message sent after the outage"
        )
        relay.assert_running()
    with engine.connect() as conn:
        most = conn.execute(sa.text("SELECT max(attempts) FROM outbox")).scalar_one()
    assert took <= AFTER_RETURN_BOUND and most <= 1, (
        f"sent {took:.1f}s after Kafka returned; a message was charged {most} attempts"
    )
