"""A lease that ends with time alone (an immediate sender that stopped before its mark) makes
the rows of its key sendable with no commit to wake the relay: the relay that sleeps while
leases are held, or have run out unmarked, looks again every WORKING_PAUSE (50 ms). Real
PostgreSQL, stub sender."""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.engines import sender_engine
from outbox.relay.store import RelayStore
from outbox.rows import PendingRow
from outbox.schema import OutboxTableSpec
from tests.integration.test_relay_wakeups import (
    BOUND,
    POLL,
    in_seconds,
    insert_row,
    sleeping_stub_relay,
)
from tests.relay_helpers import looping, owns_all_and_sleeps, wait_for

pytestmark = pytest.mark.integration

#: Seconds left on the lease when it is shortened.
LEASE_LEFT = 0.5


class LeaseEndsAfterRead(RelayStore):
    """Once armed, the next read that finds nothing returns only after ``lease_ends``
    (time.monotonic()): the lease it saw held ends between the read and the relay's look at
    the leases (``leases_held``), a window of a round trip that this widens."""

    def __init__(self, url: str) -> None:
        super().__init__(sender_engine(url), OutboxTableSpec(), "lease-end")
        self.lease_ends: float | None = None
        self.widened = False

    def read_batch(self, *args: Any, **kwargs: Any) -> list[PendingRow]:
        rows = super().read_batch(*args, **kwargs)
        if self.lease_ends is not None and not rows:
            time.sleep(max(0.0, self.lease_ends - time.monotonic()))
            self.lease_ends, self.widened = None, True
        return rows


def test_a_lease_ending_just_after_a_read_lets_its_key_go_long_before_the_poll_interval(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    store = LeaseEndsAfterRead(outbox_url)
    relay, stub = sleeping_stub_relay(outbox_url, store)
    try:
        with looping(relay):
            wait_for(lambda: owns_all_and_sleeps(relay), 30, "the relay to own all and sleep")
            held = insert_row(
                engine, "k", lease_owner="immediate-gone", lease_until=in_seconds(3600)
            )
            later = insert_row(engine, "k")
            time.sleep(0.3)
            assert not stub.acked  # both wait for the sender's lease
            with engine.begin() as conn:  # the sender's lease nears its end
                conn.execute(
                    sa.text("UPDATE outbox SET lease_until = :until WHERE id = :id"),
                    {"until": in_seconds(LEASE_LEFT), "id": held},
                )
            ended = time.monotonic() + LEASE_LEFT + 0.05
            store.lease_ends = ended
            wait_for(lambda: later in stub.acked_ids(), POLL + 5, "the held key's rows sent")
            picked_up = stub.sent_at[later] - ended
    finally:
        store.engine.dispose()
    assert store.widened
    print(f"the held key's rows picked up {picked_up * 1000:.0f} ms after the lease ended")
    assert picked_up < BOUND, picked_up
