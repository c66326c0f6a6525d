"""Scheduled messages at their edges: a cancel that rolls back after the relay passed over its
row, a downgrade past revision 0010 with prepared messages that carry a time, and cancels
racing the promotion; the chaos audit on orders the promotion must keep."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import pytest
import sqlalchemy as sa

from outbox import Outbox, migrate
from outbox.chaos import audit
from outbox.errors import NotScheduled
from outbox.prepared import PreparedMessages
from outbox.scheduled import ScheduledMessages
from outbox.schema import SHARD_COUNT
from tests.integration import test_scheduled_order
from tests.integration.test_scheduled import promote_all
from tests.integration.test_scheduled_order import write
from tests.relay_helpers import relay_config, wait_for
from tests.relay_outside import watched

audited = test_scheduled_order.audited  # the fixture, shared

pytestmark = pytest.mark.integration


def status(engine: sa.Engine, message_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        query = sa.text("SELECT status FROM outbox WHERE id = :id")
        return str(conn.execute(query, {"id": message_id}).scalar_one())


def test_a_cancel_rolled_back_after_the_due_time_is_sent_within_a_second(  # type: ignore[no-untyped-def]
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:
    topic = make_topic("sched-cancel-rollback")
    ob = Outbox(engine)
    config = relay_config(
        outbox_url, bootstrap_servers, poll_interval=8.0, rebalance_interval=8.0, metrics_port=0
    )
    with watched(config) as relay:
        wait_for(lambda: relay.owned_shards() == SHARD_COUNT, 30, "the relay to own its shards")
        time.sleep(1.0)  # idle: nothing pending
        with ob.transaction() as tx:
            due = tx.publish(topic, "remind", key="k", deliver_after=1.0).message_id
        with ob.transaction() as tx:  # a business transaction cancels, and fails after the time
            ScheduledMessages(ob).cancel(due, bind=tx.session)
            time.sleep(2.0)  # the relay woke at the due time and passed over the locked row
            tx.session.rollback()
        rolled_back = time.monotonic()
        wait_for(lambda: status(engine, due) == "sent", 30, "the message to go")
        took = time.monotonic() - rolled_back
    # Measured 5.2 s (both intervals 8 s; the relay's next wake-up). With the default
    # --rebalance-interval of 0.5 s it was 0.6 s: an idle relay wakes for its rebalance.
    assert took < 3.0, f"sent {took:.2f}s after the cancel rolled back"


#: An earlier version's commit of a prepared message (revision 0009's commit_prepared).
EARLIER_COMMIT = sa.text(
    "UPDATE outbox SET status = 'pending', seq = DEFAULT, created_at = now(), "
    "resolved_at = now(), resolved_by = 'producer', next_check_at = NULL "
    "WHERE id = :id AND status = 'prepared'"
)


def test_the_downgrade_keeps_a_prepared_message_from_going_before_its_time(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    prepared = PreparedMessages(Outbox(engine)).prepare("orders", 1, key="k", deliver_after=3600)
    try:
        migrate.downgrade(outbox_url, revision="0009_partitioned_layout")
    except Exception as error:  # refused: what the docs promise for scheduled ones
        assert "prepared" in str(error) or "deliver" in str(error)
        return
    # Downgraded: the earlier version's commit (its service or check-back) makes it pending.
    with engine.begin() as conn:
        conn.execute(EARLIER_COMMIT, {"id": prepared.message_id})
    assert status(engine, prepared.message_id) != "pending", (
        "due in an hour, pending now: the relay sends it at once"
    )


def test_a_cancel_racing_the_promotion_either_wins_and_says_so_or_loses_and_says_so(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    ob = Outbox(engine)
    with ob.transaction() as tx:
        ids = [
            tx.publish("orders", n, key=n % 7, deliver_after=3600).message_id for n in range(300)
        ]
    with engine.begin() as conn:  # due one after another over 1.5 s
        conn.execute(
            sa.text(
                "UPDATE outbox SET deliver_at = now() + interval '5 milliseconds' "
                "* (seq - (SELECT min(seq) FROM outbox))"
            )
        )
    scheduled = ScheduledMessages(ob)
    said: dict[uuid.UUID, str] = {}
    stop = threading.Event()

    def promote_until_stopped() -> None:
        while not stop.is_set():
            promote_all(ob.spec, outbox_url)

    promoting = threading.Thread(target=promote_until_stopped)
    promoting.start()
    try:
        for message_id in reversed(ids):  # the promotion walks forward, the cancels back
            try:
                scheduled.cancel(message_id)
                said[message_id] = "cancelled"
            except NotScheduled as refused:
                said[message_id] = str(refused.status)
    finally:
        stop.set()
        promoting.join(30)
    with engine.connect() as conn:
        query = sa.text("SELECT id, status FROM outbox WHERE id = ANY(:ids)")
        found = {row.id: row.status for row in conn.execute(query, {"ids": ids})}
    # They met: the first due were promoted, the last cancelled (measured 176/124, 211/89).
    assert set(Counter(said.values())) == {"cancelled", "pending"}
    assert said == found  # a cancel that said so is never sent; one refused left it pending
    assert set(found.values()) <= {"cancelled", "pending"}


def planted(order: list[uuid.UUID], topic: str) -> list[audit.TopicRecord]:
    """The messages as if the relay had sent them in this order (one partition, one key)."""
    return [audit.TopicRecord(m, topic, 0, offset, b"k") for offset, m in enumerate(order)]


def test_the_audit_counts_the_promotion_overtaking_what_it_must_follow_or_precede(  # type: ignore[no-untyped-def]
    audited, outbox_url
) -> None:
    ob = Outbox(audited)
    with audited.begin() as conn:  # committed before the promotion began
        before = write(ob, conn, "orders", "before")
    with audited.begin() as conn:
        due = write(ob, conn, "orders", "due", deliver_after=3600)
    with audited.begin() as conn:
        conn.execute(sa.text("UPDATE outbox SET deliver_at = now() WHERE id = :id"), {"id": due})
    assert promote_all(ob.spec, outbox_url) == 1
    with audited.begin() as conn:  # written after the promotion committed
        after = write(ob, conn, "orders", "after")
    rows = audit.row_facts(audited, ["orders"])
    assert audit.order_violations(planted([before, due, after], "orders"), rows) == []
    for wrong in ([due, before, after], [before, after, due]):
        unordered: list[str] = []
        assert len(audit.order_violations(planted(wrong, "orders"), rows, unordered)) == 1
        assert unordered == []  # not taken for an inversion the promise allows
