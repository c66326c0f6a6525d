"""Exactly-once, what one Kafka transaction may hold: a batch of 20,000 rows of one shard,
whose progress record (every id of the batch) is over a megabyte, is sent all the same; and a
transaction that keeps failing for its progress record is counted where an operator looks.
Real PostgreSQL and Kafka."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.devstack.topics import create_topics
from outbox.schema import SHARD_COUNT
from tests.relay_helpers import publish_orders, relay_config
from tests.relay_outside import failures_counted, mode_options, rows_by_status, wait_until, watched

pytestmark = pytest.mark.integration

ROWS = 20_000


def test_a_batch_of_twenty_thousand_rows_of_one_shard_is_sent(  # type: ignore[no-untyped-def]
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("progress-size")
    ob = Outbox(engine)
    for first in range(0, ROWS, 2000):  # one key: one shard, one transaction of them all
        with ob.transaction() as tx:
            tx.publish_many([Message(topic, {"n": n}, key="k") for n in range(first, first + 2000)])
    config = relay_config(
        outbox_url,
        bootstrap_servers,
        batch_size=ROWS,
        delivery_timeout_ms=30_000,
        **mode_options("exactly-once", "progress-size"),
    )
    with watched(config) as relay:

        def sent() -> bool:
            relay.assert_running()
            return len(rows_by_status(engine).get("sent", ())) == ROWS

        wait_until(sent, 90, f"the {ROWS} rows sent")


def test_a_transaction_that_keeps_failing_is_counted_on_the_metrics(  # type: ignore[no-untyped-def]
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("progress-refused")
    options = mode_options("exactly-once", "progress-refused")
    # The progress topic, made ahead, takes no record the relay writes (the smallest, of one
    # message, is over 100 bytes): every transaction fails at its end.
    create_topics(
        bootstrap_servers, [options["progress_topic"]], SHARD_COUNT, {"max.message.bytes": "100"}
    )
    publish_orders(engine, topic, 20)
    config = relay_config(outbox_url, bootstrap_servers, metrics_port=0, **options)
    with watched(config) as relay:

        def counted() -> bool:
            relay.assert_running()
            return bool(failures_counted(relay))

        wait_until(counted, 30, "a failure counter on /metrics above 0")
    assert "sent" not in rows_by_status(engine)  # (no transaction could commit)


def test_a_transaction_refused_for_good_is_tried_again_only_after_a_pause(  # type: ignore[no-untyped-def]
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    """Halved down to one message and still refused, a shard's transaction is not tried
    again at once, round after round: the relay pauses, doubling up to 5 s, as after an
    outage (its failures are the progress topic's, not the messages')."""
    topic = make_topic("progress-refused-pause")
    options = mode_options("exactly-once", "progress-refused-pause")
    create_topics(
        bootstrap_servers, [options["progress_topic"]], SHARD_COUNT, {"max.message.bytes": "100"}
    )
    publish_orders(engine, topic, 1)  # one shard, one message
    config = relay_config(outbox_url, bootstrap_servers, metrics_port=0, **options)
    with watched(config) as relay:

        def batches_failed() -> float:
            relay.assert_running()
            return failures_counted(relay).get("outbox_relay_batches_failed", 0.0)

        wait_until(lambda: batches_failed() > 0, 30, "a failed transaction counted")
        first = batches_failed()
        time.sleep(10)
        # Pauses of 0.5, 1, 2, 4 and 5 s: five tries in ten seconds, a few more at most.
        assert batches_failed() - first <= 8
    assert set(rows_by_status(engine)) == {"pending"}  # charged nothing, sent nothing
