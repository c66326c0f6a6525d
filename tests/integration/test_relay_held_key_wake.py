"""A key's later row held back behind a row the immediate sender holds becomes sendable when
the sender marks that row sent: a sleeping relay should pick it up far sooner than its poll
interval. Real relay loop on a real PostgreSQL, stub sender."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.engines import sender_engine
from outbox.relay.reading import shard_window
from outbox.relay.store import RelayStore
from outbox.rows import OutboxRows, PendingRow
from outbox.schema import DEFAULT_SPEC, SHARD_COUNT, OutboxTableSpec, shard_of
from outbox.sending import Ack
from tests.integration.test_relay_wakeups import (
    BOUND,
    POLL,
    in_seconds,
    insert_row,
    sleeping_stub_relay,
)
from tests.relay_helpers import looping, owns_all_and_sleeps, wait_for

pytestmark = pytest.mark.integration


def test_a_row_held_back_behind_an_immediately_sent_row_goes_when_that_row_is_marked(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    relay, stub = sleeping_stub_relay(outbox_url)
    owner = "immediate-test"
    with looping(relay):
        wait_for(lambda: owns_all_and_sleeps(relay), 30, "the relay to own every shard and sleep")
        # The first row of the key is in flight with an immediate sender (leased to it); the
        # second was written without one (or given back by the sender's order check): the
        # relay is woken by its insert, reads it, holds it back behind the leased row, and
        # sleeps again.
        held = insert_row(engine, "k", lease_owner=owner, lease_until=in_seconds(3600))
        later = insert_row(engine, "k")
        time.sleep(0.3)
        assert relay.asleep and not stub.acked
        started = time.monotonic()
        rows = OutboxRows(outbox_url, DEFAULT_SPEC, owner)
        try:
            rows.record_outcome([Ack(held, 0, 1)])  # what a successful immediate send does
        finally:
            rows.close()
        wait_for(lambda: later in stub.acked_ids(), POLL + 2, "the later row sent")
        picked_up = stub.sent_at[later] - started
    print(f"later row of the key picked up {picked_up * 1000:.1f} ms after the mark")
    assert picked_up < BOUND, picked_up


class MarkedAfterRead(RelayStore):
    """Once armed, the next read that finds nothing runs ``mark`` (the immediate sender's mark
    of the key's head) before it returns: the mark lands between a read that found the key
    held and the relay's look at the leases, a window of a round trip that this widens."""

    def __init__(self, url: str) -> None:
        super().__init__(sender_engine(url), OutboxTableSpec(), "marked-after-read")
        self.mark: Callable[[], None] | None = None
        self.marked_at: float | None = None

    def read_batch(self, *args: Any, **kwargs: Any) -> list[PendingRow]:
        rows = super().read_batch(*args, **kwargs)
        if self.mark is not None and not rows:
            mark, self.mark = self.mark, None
            mark()
            self.marked_at = time.monotonic()
        return rows


def test_a_row_held_back_goes_at_once_when_its_head_is_marked_just_after_a_read(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    """The relay stops looking again every WORKING_PAUSE (50 ms) once no lease is left: the
    read after the mark must still come, though the shard was just read and found held."""
    store = MarkedAfterRead(outbox_url)
    relay, stub = sleeping_stub_relay(outbox_url, store)
    owner = "immediate-test"
    try:
        with looping(relay):
            wait_for(lambda: owns_all_and_sleeps(relay), 30, "the relay to own all and sleep")
            held = insert_row(engine, "k", lease_owner=owner, lease_until=in_seconds(3600))
            later = insert_row(engine, "k")
            time.sleep(0.3)
            assert relay.asleep and not stub.acked

            def mark() -> None:
                rows = OutboxRows(outbox_url, DEFAULT_SPEC, owner)
                try:
                    rows.record_outcome([Ack(held, 0, 1)])  # a successful immediate send
                finally:
                    rows.close()

            store.mark = mark
            wait_for(lambda: later in stub.acked_ids(), POLL + 2, "the later row sent")
            assert store.marked_at is not None
            picked_up = stub.sent_at[later] - store.marked_at
    finally:
        store.engine.dispose()
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
    relay, stub = sleeping_stub_relay(outbox_url)
    owner = "immediate-test"
    held_key = "h"
    shard = shard_of(held_key.encode(), uuid.uuid4())
    free_key = next(
        k for k in (f"f{n}" for n in range(1000)) if shard_of(k.encode(), uuid.uuid4()) == shard
    )
    with looping(relay):
        wait_for(lambda: owns_all_and_sleeps(relay), 30, "the relay to own every shard and sleep")
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
            wait_for(lambda: free in stub.acked_ids(), POLL + 2, "the free row sent")
            picked_up = stub.sent_at[free] - started
        except AssertionError:
            picked_up = float("inf")
    print(f"free row behind a held key's backlog of {behind} picked up after {picked_up:.3f} s")
    assert picked_up < BOUND, picked_up
    assert all(r.key != held_key.encode() for r in stub.acked)  # the held key keeps its order
