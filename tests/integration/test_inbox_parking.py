"""Parking keeps its word, on the real stack: a record parked for having no identity is applied
on retry only under the identity the inbox's ``missing_id`` gives it (or stays parked, with
the reason); a copy of an id whose first copy was not applied is parked beside it, or held
back, and never counted as a duplicate; a parked handler error keeps its traceback."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import orjson
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from confluent_kafka import Producer

from outbox.cli import main
from outbox.inbox import RawRecord
from outbox.inbox.apply import MAX_ERROR_TEXT
from tests import inbox_app
from tests.inbox_helpers import (
    assert_exactly_once,
    consumer_config,
    ledger,
    ledger_count,
    prepare_database,
    running_consumer,
)
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration

JSON = ("content-type", b"application/json")


@pytest.fixture
def inbox_engine(outbox_url: str) -> Iterator[sa.Engine]:
    engine = prepare_database(outbox_url)
    yield engine
    engine.dispose()


def group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def parked_rows(engine: sa.Engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM inbox_parked ORDER BY id")).all())


def retry_all(outbox_url: str) -> None:
    retried = CliRunner().invoke(
        main, ["inbox", "parked", "retry", "--all", "--database-url", outbox_url]
    )
    assert retried.exit_code == 0, retried.output


def produce_records(bootstrap: str, topic: str, records: list[tuple[int, dict, list]]) -> None:  # type: ignore[type-arg]
    """(partition, value, headers) each, in this order."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for partition, value, headers in records:
        producer.produce(topic, orjson.dumps(value), key=b"k", partition=partition, headers=headers)
    assert producer.flush(30) == 0


def test_a_record_without_identity_stays_parked_on_retry_under_the_default(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-noid-retry")
    produce_records(bootstrap_servers, topic, [(0, {"n": 1, "amount": 1}, [JSON])])
    inbox = inbox_app.make_inbox([topic], group())  # missing_id="park"
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as runner:
        wait_for(lambda: len(parked_rows(inbox_engine)) == 1, 60, "parked")
        retry_all(outbox_url)
        wait_for(lambda: parked_rows(inbox_engine)[0].attempts == 1, 30, "retried")
        assert runner.metrics.processed.labels(topic)._value.get() == 0
    [row] = parked_rows(inbox_engine)
    assert (row.reason, row.status, row.message_id) == ("no-identity", "parked", None)
    assert "outbox-id" in row.error
    assert ledger_count(inbox_engine) == 0  # nothing applied unchecked


def test_a_record_without_identity_is_applied_on_retry_under_missing_id(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-noid-custom")
    produce_records(bootstrap_servers, topic, [(0, {"n": 41, "amount": 41}, [JSON])])
    fixed = {"n": False}

    def by_order(record: RawRecord) -> str:
        if not fixed["n"]:
            raise LookupError("the order reference is not readable yet")
        return f"order-{orjson.loads(record.value or b'{}')['n']}"

    inbox = inbox_app.make_inbox([topic], group(), missing_id=by_order)
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: len(parked_rows(inbox_engine)) == 1, 60, "parked")
        assert parked_rows(inbox_engine)[0].reason == "no-identity"
        fixed["n"] = True
        retry_all(outbox_url)
        wait_for(lambda: parked_rows(inbox_engine) == [], 30, "applied on retry")
    with inbox_engine.connect() as conn:
        identities = list(conn.execute(sa.text("SELECT message_id FROM inbox")).scalars())
    assert identities == ["order-41"]  # not topic/partition/offset


def test_a_copy_of_a_parked_id_is_parked_beside_it_not_counted_as_a_duplicate(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-copy-parked")
    with inbox_engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO fail_plan VALUES (7, 100)"))
    message_id = str(uuid.uuid4()).encode()
    value = {"n": 7, "amount": 7, "fail": True}
    copy = (0, value, [("outbox-id", message_id), JSON])
    produce_records(bootstrap_servers, topic, [copy, copy])
    inbox = inbox_app.make_inbox([topic], group())
    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=1, max_wait=2.0)
    with running_consumer(inbox, config) as runner:
        wait_for(lambda: len(parked_rows(inbox_engine)) == 2, 60, "both parked")
        assert runner.metrics.duplicates.labels(topic)._value.get() == 0
        assert runner.metrics.parked.labels(topic, "handler")._value.get() == 2
        first, second = parked_rows(inbox_engine)
        assert (first.kafka_offset, second.kafka_offset) == (0, 1)
        assert first.message_id == second.message_id == message_id.decode()
        assert second.error.startswith(f"a copy of the message parked from {topic}[0]@0: ")
        # A parked handler error keeps its traceback, bounded.
        assert first.error.startswith("tests.inbox_app.PlannedFailure: planned failure of n=7")
        assert "Traceback (most recent call last):" in first.error
        assert "fail_if_planned" in first.error and len(first.error) <= MAX_ERROR_TEXT
        # Fixed and retried: one applies, the other is then a duplicate and leaves.
        with inbox_engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM fail_plan"))
        retry_all(outbox_url)
        wait_for(lambda: parked_rows(inbox_engine) == [], 30, "both handled")
    assert_exactly_once(inbox_engine, [7])


def test_a_copy_of_an_id_being_retried_is_held_back_not_counted_as_a_duplicate(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-copy-held", partitions=2)
    with inbox_engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO fail_plan VALUES (7, 100)"))
    message_id = str(uuid.uuid4()).encode()
    value = {"n": 7, "amount": 7, "fail": True}
    headers = [("outbox-id", message_id), JSON]
    produce_records(bootstrap_servers, topic, [(0, value, headers), (1, value, headers)])
    inbox = inbox_app.make_inbox([topic], group())
    # One batch holds both copies: the first fails and is retried, the second waits for it.
    config = consumer_config(
        outbox_url, bootstrap_servers, max_attempts=2, batch_size=2, max_wait=5.0
    )
    with running_consumer(inbox, config) as runner:
        wait_for(lambda: len(parked_rows(inbox_engine)) == 2, 60, "both parked")
        assert runner.metrics.duplicates.labels(topic)._value.get() == 0
    assert {row.kafka_partition for row in parked_rows(inbox_engine)} == {0, 1}
    assert ledger(inbox_engine) == []
