"""A relay whose watching relay dies (kill -9, a host gone: its sessions end, it sends no last
NOTIFY) sleeps on, watched by nobody: writers take the wake lock shared, are granted it and
never notify. docs/relay.md states the limit: a commit to its shards is sent at its next
poll (or rebalance), not lost. Real relay loops on a real PostgreSQL, stub publishers; the
dead relay is a loop frozen in place whose sessions the server ends."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import sqlalchemy as sa

from outbox.relay.daemon import Relay
from outbox.schema import DEFAULT_SPEC, SHARD_COUNT, shard_of
from tests.integration.test_relay_loop import StubPublisher, config, wait_for
from tests.integration.test_relay_wakeups import BOUND, insert_row
from tests.relay_helpers import looping

pytestmark = pytest.mark.integration

#: Poll and rebalance interval: the survivor wakes by itself only after this long.
INTERVAL = 10.0


def freeze_when_idle(relay: Relay, frozen: threading.Event, thaw: threading.Event) -> None:
    """From now on, ``relay``'s next idle turn blocks until ``thaw`` (it holds what it holds)."""
    assert relay._wake is not None
    wake = relay._wake

    def frozen_idle(timeout: float) -> bool:
        frozen.set()
        thaw.wait()
        return False

    wake.idle = frozen_idle  # type: ignore[method-assign]


def test_a_commit_after_the_watcher_died_goes_at_the_survivors_next_look(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    first_stub = StubPublisher(latency=0.002)
    first = Relay(
        config(outbox_url, poll_interval=INTERVAL, rebalance_interval=INTERVAL),
        publisher=first_stub,
    )
    second_stub = StubPublisher(latency=0.002)
    second = Relay(
        config(outbox_url, poll_interval=INTERVAL, rebalance_interval=INTERVAL),
        publisher=second_stub,
    )
    frozen, thaw = threading.Event(), threading.Event()
    with looping(first):
        wait_for(lambda: first._ownership is not None and first._wake is not None)
        with looping(second):
            half = SHARD_COUNT // 2

            def settled() -> bool:
                relays = (first, second)
                return all(
                    r._ownership is not None and len(r._ownership.owned) == half for r in relays
                ) and any(r._wake is not None and r._wake.asleep for r in relays)

            wait_for(settled, 6 * INTERVAL)
            watcher, survivor = (first, second) if first._wake.asleep else (second, first)  # type: ignore[union-attr]
            assert survivor._ownership is not None and survivor._wake is not None
            # Right after the survivor's rebalance: it will not look by itself for a while.
            wait_for(lambda: survivor._next_rebalance - time.monotonic() > INTERVAL - 1.5, 30)
            freeze_when_idle(watcher, frozen, thaw)
            with engine.connect() as conn:  # one look for everybody: the watcher freezes
                conn.execute(
                    sa.text("SELECT pg_notify(:c, 'relay')"), {"c": DEFAULT_SPEC.notify_channel}
                )
                conn.commit()
            wait_for(frozen.is_set, 5)
            time.sleep(0.3)  # the survivor looked, found the watcher asleep, and sleeps
            with engine.begin() as conn:  # the watcher's process dies: its sessions end
                ended = conn.execute(
                    sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name LIKE :owner || '%'"
                    ),
                    {"owner": watcher.owner},
                ).scalar_one()
            assert ended >= 2

            def gone() -> bool:
                with engine.connect() as conn:
                    return not conn.execute(
                        sa.text(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE application_name LIKE :owner || '%'"
                        ),
                        {"owner": watcher.owner},
                    ).scalar_one()

            wait_for(gone, 5)
            left = survivor._next_rebalance - time.monotonic()
            assert left > 3, left  # the survivor will not look by itself within BOUND
            key = next(
                k
                for k in (f"s{n}" for n in range(1000))
                if shard_of(k.encode(), uuid.uuid4()) in survivor._ownership.owned
            )
            started = time.monotonic()
            row = insert_row(engine, key)
            try:
                acked = (first_stub.acked, second_stub.acked)
                wait_for(lambda: row in {r.id for a in acked for r in a}, 2 * INTERVAL)
                picked_up = time.monotonic() - started
            finally:
                thaw.set()
    print(f"commit to the survivor's shard picked up after {picked_up * 1000:.1f} ms")
    # Not woken (the documented limit: a wake-up takes milliseconds), but sent at the
    # survivor's next look, which came by its poll interval or rebalance.
    assert BOUND < picked_up < INTERVAL + 2, picked_up
