"""Stepping aside on a real broker: an exactly-once relay whose own path to Kafka breaks hands
its shards to a relay that can still publish."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer

from outbox.chaos.proxy import FaultProxy
from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.topics import consume_messages
from outbox.relay import marking, producers
from outbox.relay.config import EXACTLY_ONCE, RelayConfig
from outbox.relay.daemon import Relay
from outbox.schema import SHARD_COUNT
from tests.relay_helpers import looping, message_id, publish_orders, statuses, wait_for

pytestmark = pytest.mark.integration

#: The take-over's wait for a transactional producer's start, shortened from 60 s.
INIT_TIMEOUT = 3.0


class QuickInitProducer(Producer):
    def init_transactions(self, *timeout: float) -> None:
        super().init_transactions(min(INIT_TIMEOUT, *timeout) if timeout else INIT_TIMEOUT)


def test_a_relay_whose_path_to_kafka_breaks_hands_its_shards_to_one_that_can_publish(
    engine: sa.Engine,
    outbox_url: str,
    kafka_broker: KafkaBroker,
    faulty_kafka: FaultProxy,
    make_topic,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without stepping aside, the broken relay locks its share again at every rebalance,
    fails to take it over, and the messages of half the shards wait for its path to heal."""
    monkeypatch.setattr(producers, "Producer", QuickInitProducer)
    monkeypatch.setattr(marking, "LOST_SHARD_HOLD_OFF", 0.5)
    topic = make_topic("step-aside", partitions=3)
    prefix = f"step-aside-{uuid.uuid4().hex[:6]}"

    def config(bootstrap: str) -> RelayConfig:
        return RelayConfig(
            database_url=outbox_url,
            kafka={"bootstrap.servers": bootstrap},
            mode=EXACTLY_ONCE,
            batch_size=100,
            poll_interval=0.2,
            rebalance_interval=0.3,
            delivery_timeout_ms=4000,
            transactional_id_prefix=prefix,
            progress_topic=f"{prefix}-progress",
        )

    healthy = Relay(config(kafka_broker.bootstrap_servers))
    broken = Relay(config(f"127.0.0.1:{faulty_kafka.listen_port}"))
    with looping(healthy):
        wait_for(
            lambda: healthy._ownership is not None and healthy._ownership.serving,
            60,
            "the healthy relay serving",
        )
        with looping(broken):
            wait_for(
                lambda: broken._ownership is not None and len(broken._ownership.owned) > 0,
                60,
                "the other relay owning its share",
            )
            first = publish_orders(engine, topic, 200, keys=50)
            wait_for(lambda: statuses(engine) == {"sent": 200}, 60, "the first messages sent")
            faulty_kafka.stall()  # the broken relay's path only
            later = publish_orders(engine, topic, 400, keys=50, start=200)
            wait_for(lambda: broken.health.stepped_aside, 90, "the broken relay stepping aside")
            wait_for(lambda: statuses(engine) == {"sent": 600}, 60, "every message sent")
            assert healthy._ownership is not None
            assert len(healthy._ownership.owned) == SHARD_COUNT
            assert not broken.health.ready
    faulty_kafka.heal()
    on_topic = consume_messages(kafka_broker.bootstrap_servers, topic, expect=600, timeout=30)
    copies = Counter(message_id(record) for record in on_topic)
    assert set(copies) == set(first + later) and set(copies.values()) == {1}
