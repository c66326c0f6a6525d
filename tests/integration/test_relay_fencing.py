"""A relay whose shard was taken over mid-flight: its sender is fenced, gives the shard up
and reports the batch as not sent, instead of raising out of the relay's loop."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from confluent_kafka import KafkaError, Message
from confluent_kafka.admin import AdminClient

from outbox import ID_HEADER
from outbox.records import OutboxRecord
from outbox.relay.progress import ensure_progress_topic
from outbox.relay.transactions import ExactlyOnceSender
from tests.relay_helpers import send_and_wait, wait_for

pytestmark = pytest.mark.integration

SENDER_LOG = "outbox.relay.transactions"


def records(topic: str, count: int) -> list[OutboxRecord]:
    made = []
    for n in range(count):
        record_id = uuid.uuid4()
        headers: list[tuple[str, bytes | None]] = [(ID_HEADER, str(record_id).encode())]
        made.append(OutboxRecord(record_id, n, 0, topic, b"k", b"%d" % n, headers))
    return made


def old_and_new_owner(bootstrap_servers: str) -> tuple[ExactlyOnceSender, ExactlyOnceSender]:
    """Two senders of one transactional-id prefix: the second's take-over fences the first."""
    prefix = f"fence-{uuid.uuid4().hex[:8]}"
    progress = f"p-{prefix}"
    config: dict[str, Any] = {"bootstrap.servers": bootstrap_servers}
    ensure_progress_topic(AdminClient(config), progress)

    def sender(owner: str) -> ExactlyOnceSender:
        return ExactlyOnceSender(
            config,
            transactional_id_prefix=prefix,
            progress_topic=progress,
            owner=owner,
            delivery_timeout_ms=10_000,
        )

    return sender("old"), sender("new")


def test_a_fenced_sender_gives_the_shard_up_and_the_new_owner_sends(
    bootstrap_servers: str, make_topic: Any
) -> None:
    topic = make_topic("fenced")
    old, new = old_and_new_owner(bootstrap_servers)
    try:
        old.take_over([0])
        batch = records(topic, 50)
        assert len(send_and_wait(old, batch[:10]).acks) == 10  # the old owner works until fenced
        new.take_over([0])  # fences the old owner's producer
        result = send_and_wait(old, batch[10:])
        assert result.lost_shards == [0]
        assert not result.acks and not result.errors
        assert sorted(result.not_attempted) == sorted(r.id for r in batch[10:])
        # The shard was given up: the old owner tries none of its batches any more.
        again = send_and_wait(old, batch[10:])
        assert not again.acks and not again.lost_shards
        assert sorted(again.not_attempted) == sorted(r.id for r in batch[10:])
        sent = send_and_wait(new, batch[10:])
        assert len(sent.acks) == 40 and not sent.lost_shards
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize("ending", ["let_go", "close"])
def test_a_fenced_producer_with_reports_pending_is_let_go_without_raising(
    ending: str, bootstrap_servers: str, make_topic: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer fenced while its delivery reports wait: its flush raises the fence, and the
    reports that run after it turn that into a SystemError (seen as a relay that crashed when
    its database went away beside two Kafka nodes down, letting go of its shards). Letting
    the shard go, or closing the sender, logs it and goes on."""
    topic = make_topic("fenced-pending")
    reports: dict[uuid.UUID, KafkaError | None] = {}

    def report(error: KafkaError | None, _message: Message) -> None:
        reports[uuid.uuid4()] = error  # keyed by a message id, as the relay's reports are

    def let_go_lines() -> list[str]:
        logged = [r.getMessage() for r in caplog.records if r.name == SENDER_LOG]
        return [message for message in logged if "let go as it stands" in message]

    caplog.set_level(logging.INFO, logger=SENDER_LOG)
    old, new = old_and_new_owner(bootstrap_servers)
    try:
        old.take_over([0])
        producer = old.producers[0]  # its transaction, made by hand with reports to wait for
        producer.begin_transaction()
        for n in range(100):
            producer.produce(topic, b"%d" % n, on_delivery=report)
        assert producer.flush(10) == 0 and list(reports.values()) == [None] * 100
        new.take_over([0])  # fences the old owner's producer, mid-transaction
        for n in range(100):
            producer.produce(topic, b"%d" % n, on_delivery=report)
        del producer
        if ending == "let_go":
            old.let_go([0])
            # Dropped producers are closed off the loop, on the sender's closing thread.
            wait_for(lambda: let_go_lines(), 30, "the fenced producer let go")
            untried = send_and_wait(old, records(topic, 5))
            assert len(untried.not_attempted) == 5 and not untried.acks
        else:
            old.close()
        let_go = let_go_lines()
        assert len(let_go) == 1 and "fenced" in let_go[0], let_go
        sent = send_and_wait(new, records(topic, 20))
        assert len(sent.acks) == 20 and not sent.lost_shards
    finally:
        if ending == "let_go":
            old.close()
        new.close()
