"""A consumer with nothing to read turns ready again once Kafka is back after a short outage
(its group membership kept: no new assignment, no offset to commit)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from outbox.chaos.proxy import FaultProxy
from tests import inbox_app
from tests.inbox_helpers import consumer_config, prepare_database, running_consumer
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


def test_an_idle_consumer_is_ready_again_once_kafka_is_back(
    outbox_url: str, faulty_kafka: FaultProxy, make_topic: Callable[..., str]
) -> None:
    prepare_database(outbox_url).dispose()
    topic = make_topic("inbox-kafka-back")
    inbox = inbox_app.make_inbox([topic], f"g-{uuid.uuid4().hex[:8]}")
    config = consumer_config(outbox_url, f"127.0.0.1:{faulty_kafka.listen_port}")
    with running_consumer(inbox, config) as runner:
        wait_for(lambda: runner.health.ready, 60, "ready")
        faulty_kafka.drop()
        wait_for(lambda: not runner.health.kafka_ok, 30, "Kafka out of reach")
        faulty_kafka.heal()  # seconds later: far within the group's session timeout
        wait_for(lambda: runner.health.ready, 30, "ready again")
