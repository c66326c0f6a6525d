"""A relay whose own path to Kafka breaks while it owns its full share, beside a relay that
reaches Kafka: the broken one gives its shards up and the other sends them, within
:data:`HAND_OVER_BOUND` seconds, well inside the delivery timeout. Real PostgreSQL and Kafka;
the broken relay reaches the broker only through a fault proxy, the other directly."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from outbox.chaos.proxy import FaultProxy
from outbox.schema import SHARD_COUNT
from tests.relay_helpers import publish_orders, relay_config, statuses
from tests.relay_outside import mode_options, wait_until, watched

pytestmark = pytest.mark.integration

#: Seconds from the stall of the broken relay's path until every message is sent.
HAND_OVER_BOUND = 15.0
#: Twice the bound: the hand-over must not wait for Kafka's answer to time out.
DELIVERY_TIMEOUT_MS = 30_000


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_a_relay_whose_path_to_kafka_breaks_hands_its_full_share_over(  # type: ignore[no-untyped-def]
    engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    faulty_kafka: FaultProxy,
    make_topic,
    mode: str,
) -> None:
    topic = make_topic("own-path", partitions=3)
    options = {
        **mode_options(mode, "own-path"),
        "metrics_port": 0,
        "delivery_timeout_ms": DELIVERY_TIMEOUT_MS,
    }
    healthy_config = relay_config(outbox_url, bootstrap_servers, **options)
    broken_config = relay_config(outbox_url, f"127.0.0.1:{faulty_kafka.listen_port}", **options)
    with watched(healthy_config, "healthy") as healthy:
        wait_until(lambda: healthy.owned_shards() == SHARD_COUNT, 60, "the first relay's shards")
        with watched(broken_config, "broken") as broken:
            half = SHARD_COUNT // 2
            wait_until(
                lambda: healthy.owned_shards() == broken.owned_shards() == half,
                60,
                "each relay owning its share",
            )
            publish_orders(engine, topic, 200, keys=50)
            wait_until(lambda: statuses(engine) == {"sent": 200}, 60, "both relays sending")
            faulty_kafka.stall()  # the broken relay's path only
            publish_orders(engine, topic, 400, keys=50, start=200)
            took = wait_until(
                lambda: statuses(engine) == {"sent": 600}, HAND_OVER_BOUND, "every message sent"
            )
            assert healthy.owned_shards() == SHARD_COUNT, f"sent in {took:.1f}s"
            broken.assert_running()
            faulty_kafka.heal()  # so that it stops in time
