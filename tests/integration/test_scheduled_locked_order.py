"""Two scheduled messages of one key while a cancel of the first, held open past both due
times, rolls back: they reach the topic in the order of their ``deliver_at``, as
docs/scheduled.md promises for a key's scheduled messages. Real PostgreSQL and Kafka."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.devstack.topics import consume_messages
from outbox.scheduled import ScheduledMessages
from tests.relay_helpers import message_id, relay_config
from tests.relay_outside import all_sent, wait_until, watched

pytestmark = pytest.mark.integration

FIRST_DUE = 1.5
#: The second falls due this long after the first.
GAP = 0.7


def test_scheduled_messages_of_a_key_go_in_deliver_at_order_past_a_cancel_rolled_back(  # type: ignore[no-untyped-def]
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("sched-locked-order")
    ob = Outbox(engine)
    config = relay_config(outbox_url, bootstrap_servers, metrics_port=0)
    with watched(config) as relay:
        wait_until(lambda: relay.get("/readyz")[0] == 200, 60, "the relay ready")
        with ob.transaction() as tx:
            first = tx.publish(topic, "first", key="k", deliver_after=FIRST_DUE).message_id
            second = tx.publish(topic, "second", key="k", deliver_after=FIRST_DUE + GAP).message_id
        with ob.transaction() as tx:  # a business transaction cancels the first, then fails
            ScheduledMessages(ob).cancel(first, bind=tx.session)
            time.sleep(FIRST_DUE + GAP + 1.5)  # both are due, the second for 1.5 s
            tx.session.rollback()
        wait_until(lambda: all_sent(engine, [first, second]), 30, "both messages sent")
        relay.assert_running()
    on_topic = [message_id(r) for r in consume_messages(bootstrap_servers, topic, expect=2)]
    named = {first: "first", second: "second"}
    assert [named[m] for m in on_topic] == ["first", "second"]
