"""The relay behind a faulty network: Kafka unreachable at start, then reachable."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.chaos.proxy import FaultProxy
from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.procs import free_port
from tests.relay_helpers import (
    publish_orders,
    start_relay_process,
    statuses,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def proxy(kafka_broker: KafkaBroker) -> Iterator[FaultProxy]:
    """A proxy to the broker (bootstrap only: the broker advertises its own address)."""
    proxy = FaultProxy(free_port(), kafka_broker.port)
    proxy.start()
    yield proxy
    proxy.close()


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_a_relay_started_while_kafka_is_unreachable_waits_and_then_delivers(
    mode: str, engine: sa.Engine, outbox_url: str, proxy: FaultProxy, make_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("unreachable")
    proxy.drop()  # every connection to the broker is reset
    prefix = f"net-{mode[:5]}-{topic}"
    log = tmp_path / "relay.log"
    relay = start_relay_process(
        outbox_url,
        f"127.0.0.1:{proxy.listen_port}",
        "--mode",
        mode,
        "--transactional-id-prefix",
        prefix,
        "--progress-topic",
        f"p-{prefix}",
        log=log,
        ready=False,
    )
    publish_orders(engine, topic, 100)
    # A relay takes shards only once Kafka answers it: it probes, and says it is out of reach.
    wait_for(
        lambda: any(s in log.read_text() for s in ("Kafka error", "Kafka out of reach")),
        40,
        "the relay to meet the unreachable broker",
    )
    assert relay.poll() is None, "the relay gave up while Kafka was unreachable"
    assert statuses(engine) == {"pending": 100}
    proxy.heal()
    wait_for(lambda: statuses(engine) == {"sent": 100}, 90, "delivery once Kafka is back")
    assert relay.poll() is None
    assert stop_process(relay) == 0
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_every_line_a_relay_writes_is_json_also_kafkas_own(
    mode: str, outbox_url: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    import json

    proxy.drop()  # librdkafka logs every failed connection
    log = tmp_path / "relay.log"
    relay = start_relay_process(
        outbox_url, f"127.0.0.1:{proxy.listen_port}", "--mode", mode, log=log, ready=False
    )
    wait_for(lambda: "outbox.kafka" in log.read_text(), 40, "librdkafka's own log lines")
    assert stop_process(relay) == 0
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    for line in lines:
        assert json.loads(line)["msg"], line
