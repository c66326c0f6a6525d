"""What the inbox consumer says about Kafka, on the real stack: with Kafka down, one line per
cause (librdkafka's own line for a broker connection that fails, not a second one of the
consumer's for the same failure); a subscribed topic that does not exist is named in the log
and in /readyz, until it is created."""

from __future__ import annotations

import logging
import re
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from outbox.chaos.proxy import FaultProxy
from outbox.inbox import InboxRunner
from outbox.logs import KAFKA_LOGGER
from tests import inbox_app
from tests.inbox_helpers import consumer_config, prepare_database, running_consumer
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


def group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def readyz(runner: InboxRunner) -> tuple[int, str]:
    assert runner.metrics_address is not None
    host, port = runner.metrics_address
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/readyz", timeout=2) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def reported_error(message: str) -> str | None:
    """The text of the KafkaError a line of the consumer reports (``str="..."``), if any."""
    found = re.search(r'str="(.*)"\}', message)
    return found.group(1) if found else None


def test_kafka_down_is_one_line_per_cause(
    outbox_url: str,
    faulty_kafka: FaultProxy,
    make_topic: Callable[..., str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    prepare_database(outbox_url).dispose()
    topic = make_topic("inbox-kafka-down")
    inbox = inbox_app.make_inbox([topic], group())
    # librdkafka's lines through the daemons' logger, as `outbox consume` sets it.
    config = consumer_config(
        outbox_url, f"127.0.0.1:{faulty_kafka.listen_port}", kafka={"logger": KAFKA_LOGGER}
    )
    with caplog.at_level(logging.INFO), running_consumer(inbox, config) as runner:
        wait_for(lambda: runner.health.ready, 60, "ready")
        caplog.clear()
        faulty_kafka.drop()
        try:
            wait_for(lambda: not runner.health.kafka_ok, 30, "Kafka out of reach")
            wait_for(
                lambda: sum(r.name == KAFKA_LOGGER.name for r in caplog.records) >= 3,
                30,
                "librdkafka to report the broker's failures",
            )
        finally:
            faulty_kafka.heal()
        during = list(caplog.records)
    librdkafka = [r.getMessage() for r in during if r.name == KAFKA_LOGGER.name]
    consumer = [r.getMessage() for r in during if r.name == "outbox.inbox"]
    # Each failure librdkafka logs is not logged again by the consumer.
    again = [
        line
        for line in consumer
        if (text := reported_error(line)) and any(kafka.endswith(text) for kafka in librdkafka)
    ]
    assert not again, (again, librdkafka)


def test_a_missing_topic_is_named_in_the_log_and_readyz_until_it_exists(
    outbox_url: str, bootstrap_servers: str, caplog: pytest.LogCaptureFixture
) -> None:
    prepare_database(outbox_url).dispose()
    missing = f"inbox-missing-{uuid.uuid4().hex[:8]}"
    inbox = inbox_app.make_inbox([missing], group())
    config = consumer_config(
        outbox_url,
        bootstrap_servers,
        metrics_port=0,
        kafka={"topic.metadata.refresh.interval.ms": 1000},  # finds the topic once created
    )
    with caplog.at_level(logging.INFO, "outbox.inbox"), running_consumer(inbox, config) as runner:
        wait_for(lambda: runner.metrics_address is not None, 30, "the health server")
        wait_for(lambda: f"topic {missing}" in readyz(runner)[1], 60, "readyz to name it")
        status, body = readyz(runner)
        assert status == 503 and "joining the consumer group" not in body, body
        named = [r for r in caplog.records if missing in r.getMessage()]
        assert len(named) == 1 and named[0].levelno == logging.WARNING, named
        assert "does not exist" in named[0].getMessage()
        admin = AdminClient({"bootstrap.servers": bootstrap_servers})
        admin.create_topics([NewTopic(missing, 1, 1)])[missing].result(30)
        try:
            wait_for(lambda: readyz(runner)[0] == 200, 60, "ready once the topic exists")
        finally:
            admin.delete_topics([missing])[missing].result(30)
