"""A key's later row held back behind a row the immediate sender holds becomes sendable when
the sender marks that row sent: a sleeping relay should pick it up far sooner than its poll
interval. Real relay loop on a real PostgreSQL, stub publisher."""

from __future__ import annotations

import time
import uuid

import pytest
import sqlalchemy as sa

from outbox.relay.daemon import Relay
from outbox.relay.store import shard_window
from outbox.rows import OutboxRows
from outbox.schema import DEFAULT_SPEC, SHARD_COUNT, shard_of
from outbox.sending import Ack
from tests.integration.test_relay_loop import StubPublisher, config, wait_for
from tests.integration.test_relay_wakeups import BOUND, POLL, in_seconds, insert_row
from tests.relay_helpers import looping, owns_all_and_sleeps

pytestmark = pytest.mark.integration


def test_a_row_held_back_behind_an_immediately_sent_row_goes_when_that_row_is_marked(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    stub = StubPublisher(latency=0.002)
    relay = Relay(config(outbox_url, poll_interval=POLL, rebalance_interval=POLL), publisher=stub)
    owner = "immediate-test"
    with looping(relay):
        wait_for(lambda: owns_all_and_sleeps(relay))
        # The first row of the key is in flight with an immediate sender (leased to it); the
        # second was written without one (or given back by the sender's order check): the
        # relay is woken by its insert, reads it, holds it back behind the leased row, and
        # sleeps again.
        held = insert_row(engine, "k", lease_owner=owner, lease_until=in_seconds(3600))
        later = insert_row(engine, "k")
        time.sleep(0.3)
        assert relay._wake.asleep and not stub.acked
        started = time.monotonic()
        rows = OutboxRows(outbox_url, DEFAULT_SPEC, owner)
        try:
            rows.record_outcome([Ack(held, 0, 1)])  # what a successful immediate send does
        finally:
            rows.close()
        wait_for(lambda: later in {r.id for r in stub.acked}, POLL + 2)
        picked_up = time.monotonic() - started
    print(f"later row of the key picked up {picked_up * 1000:.1f} ms after the mark")
    assert picked_up < BOUND, picked_up


@pytest.mark.parametrize(
    "windows",
    [
        pytest.param(0.5, id="half-a-window"),
        pytest.param(6, id="six-windows"),
    ],
)
def test_a_held_keys_backlog_does_not_hide_another_keys_row(engine, outbox_url, windows) -> None:  # type: ignore[no-untyped-def]
    stub = StubPublisher(latency=0.002)
    relay = Relay(config(outbox_url, poll_interval=POLL, rebalance_interval=POLL), publisher=stub)
    owner = "immediate-test"
    held_key = "h"
    shard = shard_of(held_key.encode(), uuid.uuid4())
    free_key = next(
        k for k in (f"f{n}" for n in range(1000)) if shard_of(k.encode(), uuid.uuid4()) == shard
    )
    with looping(relay):
        wait_for(lambda: owns_all_and_sleeps(relay))
        # The head of the key is with an immediate sender; its later rows, given back to the
        # relay (the sender's order check), wait behind it: more of them than a read's window.
        insert_row(engine, held_key, lease_owner=owner, lease_until=in_seconds(3600))
        # (The smallest window a read of its shard can have: its share of a batch, at least 100.)
        behind = int(windows * shard_window(relay.config.batch_size, SHARD_COUNT))
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO outbox (id, shard, topic, key, value) "
                    "SELECT gen_random_uuid(), :shard, 'wake', :key, 'v' "
                    "FROM generate_series(1, :n)"
                ),
                {"shard": shard, "key": held_key.encode(), "n": behind},
            )
        time.sleep(0.3)
        assert not stub.acked
        started = time.monotonic()
        free = insert_row(engine, free_key)  # another key, same shard: free to go
        try:
            wait_for(lambda: free in {r.id for r in stub.acked}, POLL + 2)
            picked_up = time.monotonic() - started
        except AssertionError:
            picked_up = float("inf")
    print(f"free row behind a held key's backlog of {behind} picked up after {picked_up:.3f} s")
    assert picked_up < BOUND, picked_up
    assert all(r.key != held_key.encode() for r in stub.acked)  # the held key keeps its order
