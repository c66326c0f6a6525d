"""A message the broker refuses as too large, among small ones of the same topic: only it goes
dead; the others are sent, each key's in its commit order. Real PostgreSQL and Kafka, a topic
with ``max.message.bytes=20000`` and a 60 KB message (under the publish limit of 1,000,000
bytes, so the service could write it).

librdkafka packs every message of a partition queued while its last request was out into one
record batch; the broker refuses a batch over the limit whole, and every message of it fails
with MSG_SIZE_TOO_LARGE, the small ones beside the large one alike."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.devstack.topics import consume_messages
from tests.relay_helpers import message_id, publish_orders, relay_config
from tests.relay_outside import keys_out_of_order, mode_options, rows_by_status, wait_until, watched

pytestmark = pytest.mark.integration

KEYS = 11
SMALL = 400


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_only_the_message_too_large_for_its_topic_goes_dead(  # type: ignore[no-untyped-def]
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic, mode: str
) -> None:
    topic = make_topic("poison-batch", config={"max.message.bytes": "20000"})
    publish_orders(engine, topic, SMALL // 2, keys=KEYS)
    with Outbox(engine).transaction() as tx:  # random bytes: no compression brings it under
        poison = tx.publish_many([Message(topic, os.urandom(60_000), key="key-0")])[0].message_id
    publish_orders(engine, topic, SMALL // 2, keys=KEYS, start=SMALL // 2)
    config = relay_config(outbox_url, bootstrap_servers, **mode_options(mode, "poison"))
    with watched(config) as relay:

        def settled() -> bool:
            relay.assert_running()
            return "pending" not in rows_by_status(engine)

        wait_until(settled, 60, "every row sent or dead")
    rows = rows_by_status(engine)
    dead = rows.get("dead", set())
    with engine.connect() as conn:
        reasons = Counter(
            kind
            for (kind,) in conn.execute(
                sa.text("SELECT error_kind FROM outbox WHERE status = 'dead'")
            )
        )
    assert dead == {poison}, f"{len(dead)} dead ({dict(reasons)}), the large message alone expected"
    assert reasons == {"message_too_large": 1}
    assert len(rows.get("sent", ())) == SMALL
    records = consume_messages(bootstrap_servers, topic, expect=SMALL, timeout=30)
    ids = [message_id(record) for record in records]
    assert set(ids) == rows["sent"]
    assert keys_out_of_order(engine, records, ids) == {}
