"""The relay loop behind the MessageSource interface: the scheduled messages' promotion, kept
by the store, counts into the relay's metrics whichever store it is given; whatever the read
groups (``read_groups``, which the model-based test draws), the idle shards are read beside
one whose mark a row lock holds. Real PostgreSQL, the loop's stub publisher."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.engines import sender_engine
from outbox.relay.daemon import Relay
from outbox.relay.observability import RelayMetrics
from outbox.relay.store import RelayStore
from outbox.schema import OutboxTableSpec
from tests.integration.test_relay_loop import StubPublisher, config, statuses, wait_for
from tests.integration.test_relay_row_locks import (
    LOCKS,
    publish_spread,
    row_locked,
    sent,
    shards_of,
)
from tests.relay_helpers import looping

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("own_store", [False, True])
def test_a_relay_counts_the_scheduled_messages_it_promotes_whichever_store_it_is_given(  # type: ignore[no-untyped-def]
    engine, outbox_url, own_store
) -> None:
    """``Relay(config, metrics, store=...)``: the relay's metrics are the ones it serves and
    an operator alerts on (``outbox_relay_promoted``, ``outbox_relay_scheduled_overdue``)."""
    with Outbox(engine).transaction() as tx:
        tx.publish("sched-metrics", {"n": 1}, key="k", deliver_after=0.3)
    metrics = RelayMetrics()
    store = RelayStore(sender_engine(outbox_url), OutboxTableSpec(), "own-store")
    relay = Relay(
        config(outbox_url),
        metrics,
        store=store if own_store else None,
        publisher=StubPublisher(latency=0.002),
    )
    try:
        with looping(relay):
            wait_for(lambda: statuses(engine) == {"sent": 1}, 20)
    finally:
        store.engine.dispose()
    assert metrics.promoted._value.get() == 1


@pytest.mark.parametrize("groups", [1, 4, 16])
def test_a_relay_reading_in_any_number_of_groups_reads_the_idle_shards_beside_a_held_mark(  # type: ignore[no-untyped-def]
    engine, outbox_url, groups
) -> None:
    """``read_groups`` is an optimization no guarantee depends on: a row lock that holds one
    shard's mark holds that shard only, whatever the groups (with 1, a read waits for every
    shard to be idle, but for those held)."""
    first = publish_spread(engine, "first")
    locked = first[0]
    stub = StubPublisher()
    relay = Relay(config(outbox_url), publisher=stub)
    relay.read_groups = groups
    with ExitStack() as lock:
        # Locked before the relay reads it, let go before the relay stops (its shutdown would
        # wait for the mark).
        lock.enter_context(row_locked(outbox_url, locked, LOCKS["select for update"]))
        with looping(relay):
            try:
                wait_for(lambda: len(stub.acked) >= len(first))
                wait_for(lambda: relay.metrics.marks_blocked._value.get() >= 1)
                second = publish_spread(engine, "second")
                shard = shards_of(engine, first + second)
                free = [i for i in second if shard[i] != shard[locked]]
                # Far more than a read and a mark; the lock is held for as long as this waits.
                wait_for(lambda: sent(engine, free) == set(free), timeout=8)
                assert locked not in sent(engine, [locked])
            finally:
                lock.close()
            wait_for(lambda: sent(engine, first + second) == set(first + second))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 2 * len(first)
