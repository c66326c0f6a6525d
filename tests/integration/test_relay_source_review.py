"""The relay's table source and the reads it plans: the scheduled messages' promotion counts
into the relay's metrics whichever store its source reads from; whether the relay reads every
idle shard at once (it keeps up) or a part of them at a time (behind a backlog, one shard a
read exactly-once), the idle shards are read beside one whose mark a row lock holds. Real
PostgreSQL, the stub sender."""

from __future__ import annotations

import dataclasses
import urllib.request
from contextlib import ExitStack

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from outbox import Outbox
from outbox.engines import sender_engine
from outbox.relay.daemon import Parts, Relay, _real_parts
from outbox.relay.observability import RelayMetrics
from outbox.relay.store import RelayStore
from outbox.relay.table_source import TableSource
from outbox.schema import OutboxTableSpec
from tests.integration.test_relay_row_locks import (
    LOCKS,
    publish_spread,
    row_locked,
    sent,
    shards_of,
)
from tests.relay_helpers import looping, statuses, wait_for
from tests.stub_sender import StubSender, stub_config

pytestmark = pytest.mark.integration


def served_metric(relay: Relay, name: str) -> float:
    """The sum of ``name``'s samples on the relay's /metrics."""
    wait_for(lambda: relay.metrics_server_port is not None, 20, "the metrics port")
    url = f"http://127.0.0.1:{relay.metrics_server_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


@pytest.mark.parametrize("own_store", [False, True])
def test_a_relay_counts_the_scheduled_messages_it_promotes_whichever_store_it_is_given(  # type: ignore[no-untyped-def]
    engine, outbox_url, own_store
) -> None:
    """``Relay(config, metrics, parts=...)`` with a source on a store of the caller's: the
    relay's metrics are the ones it serves and an operator alerts on
    (``outbox_relay_promoted``, ``outbox_relay_scheduled_overdue``)."""
    with Outbox(engine).transaction() as tx:
        tx.publish("sched-metrics", {"n": 1}, key="k", deliver_after=0.3)
    metrics = RelayMetrics()
    store = RelayStore(sender_engine(outbox_url), OutboxTableSpec(), "own-store")
    stub = StubSender(latency=0.002)

    def parts(relay: Relay) -> Parts:
        made = dataclasses.replace(_real_parts(relay), make_sender=lambda _relay: stub)
        if own_store:
            made = dataclasses.replace(made, source=TableSource(relay.config, store, relay.metrics))
        return made

    relay = Relay(stub_config(outbox_url, metrics_port=0), metrics, parts=parts)
    try:
        with looping(relay):
            wait_for(lambda: statuses(engine) == {"sent": 1}, 20, "the scheduled message sent")
            assert served_metric(relay, "outbox_relay_promoted_total") == 1
    finally:
        store.engine.dispose()
    assert metrics.promoted._value.get() == 1


@pytest.mark.parametrize(
    ("mode", "batch_size"),
    [
        pytest.param("at-least-once", 100, id="all-at-once"),
        pytest.param("at-least-once", 8, id="in-parts"),
        pytest.param("exactly-once", 8, id="exactly-once-a-shard-a-read"),
    ],
)
def test_a_relay_reading_all_at_once_or_in_parts_reads_the_idle_shards_beside_a_held_mark(  # type: ignore[no-untyped-def]
    engine, outbox_url, mode, batch_size
) -> None:
    """How the reads take the owned shards (all that are idle at once while the relay keeps
    up, a part at a time behind a backlog) is an optimization no guarantee depends on: a row
    lock that holds one shard's mark holds that shard only. With a batch of 8, each 48-message
    transaction is a backlog."""
    first = publish_spread(engine, "first")
    locked = first[0]
    stub = StubSender()
    relay = Relay(
        stub_config(outbox_url, mode=mode, batch_size=batch_size),
        parts=lambda relay: dataclasses.replace(
            _real_parts(relay), make_sender=lambda _relay: stub
        ),
    )
    with ExitStack() as lock:
        # Locked before the relay reads it, let go before the relay stops (its shutdown would
        # wait for the mark).
        lock.enter_context(row_locked(outbox_url, locked, LOCKS["select for update"]))
        with looping(relay):
            try:
                # Read in parts, the locked row's shard-mates may come after it: they wait.
                shard = shards_of(engine, first)
                free = [i for i in first if shard[i] != shard[locked]]
                wait_for(lambda: sent(engine, free) == set(free), 20, "the first rows sent")
                wait_for(lambda: relay.metrics.marks_blocked._value.get() >= 1, 20, "mark held")
                second = publish_spread(engine, "second")
                shard = shards_of(engine, first + second)
                free = [i for i in second if shard[i] != shard[locked]]
                # Far more than a read and a mark; the lock is held for as long as this waits.
                wait_for(lambda: sent(engine, free) == set(free), 8, "the other shards' rows")
                assert locked not in sent(engine, [locked])
            finally:
                lock.close()
            wait_for(lambda: sent(engine, first + second) == set(first + second), 20, "all sent")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 2 * len(first)
