"""Stepping aside on a real broker: an exactly-once relay whose own path to Kafka breaks hands
its shards to a relay that can still publish."""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from outbox.chaos.proxy import FaultProxy
from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.topics import consume_messages
from outbox.relay import core, transactions
from outbox.relay.config import EXACTLY_ONCE, RelayConfig
from outbox.relay.daemon import Relay
from outbox.schema import SHARD_COUNT
from tests.relay_helpers import looping, message_id, publish_orders, statuses, wait_for

pytestmark = pytest.mark.integration


def readyz(relay: Relay) -> tuple[int, str]:
    """The status and body of the relay's /readyz (0: not served yet)."""
    if relay.metrics_server_port is None:
        return 0, ""
    url = f"http://127.0.0.1:{relay.metrics_server_port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_relay_whose_path_to_kafka_breaks_hands_its_shards_to_one_that_can_publish(
    engine: sa.Engine,
    outbox_url: str,
    kafka_broker: KafkaBroker,
    faulty_kafka: FaultProxy,
    make_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without stepping aside, the broken relay locks its share again at every rebalance,
    fails to take it over, and the messages of half the shards wait for its path to heal."""
    # The take-over's wait for a transactional producer's start, and the hold-off before a
    # lost shard is taken back, shortened.
    monkeypatch.setattr(transactions, "INIT_TIMEOUT", 3.0)
    monkeypatch.setattr(core, "EVIDENCE_SECONDS", 0.5)  # the lost shard's hold-off
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
            metrics_port=0,
        )

    healthy = Relay(config(kafka_broker.bootstrap_servers))
    broken = Relay(config(f"127.0.0.1:{faulty_kafka.listen_port}"))
    with looping(healthy):
        wait_for(lambda: readyz(healthy)[0] == 200, 60, "the healthy relay ready")
        wait_for(
            lambda: len(healthy.owned_shards) == SHARD_COUNT, 60, "the healthy relay owning all"
        )
        with looping(broken):
            wait_for(lambda: len(broken.owned_shards) > 0, 60, "the other relay owning its share")
            wait_for(lambda: readyz(broken)[0] == 200, 60, "the other relay ready")
            first = publish_orders(engine, topic, 200, keys=50)
            wait_for(lambda: statuses(engine) == {"sent": 200}, 60, "the first messages sent")
            assert healthy.owned_shards and broken.owned_shards  # both sent their share
            faulty_kafka.stall()  # the broken relay's path only
            later = publish_orders(engine, topic, 400, keys=50, start=200)
            wait_for(
                lambda: not broken.owned_shards and len(healthy.owned_shards) == SHARD_COUNT,
                90,
                "the broken relay to step aside and the healthy one to take its shards",
            )
            status, body = readyz(broken)
            assert status == 503 and "stepped aside" in body, (status, body)
            wait_for(lambda: statuses(engine) == {"sent": 600}, 60, "every message sent")
            assert len(healthy.owned_shards) == SHARD_COUNT and not broken.owned_shards
            status, body = readyz(broken)
            assert status == 503 and "stepped aside" in body, (status, body)
    faulty_kafka.heal()
    on_topic = consume_messages(kafka_broker.bootstrap_servers, topic, expect=600, timeout=30)
    copies = Counter(message_id(record) for record in on_topic)
    assert set(copies) == set(first + later) and set(copies.values()) == {1}
