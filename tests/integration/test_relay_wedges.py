"""One shard's trouble must not hold the others: a take-over that does not end (a slow or
failing-over transaction coordinator), and health once a shard is wedged. Against the stub
publisher of test_relay_loop (deterministic: it decides when a take-over ends), on a real
PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import sqlalchemy as sa

from outbox.records import OutboxRecord
from outbox.relay.daemon import Relay
from outbox.relay.producers import InFlight
from outbox.schema import SHARD_COUNT
from outbox.sending import Ack
from tests.integration.test_relay_loop import (
    StubPublisher,
    by_key_in_seq_order,
    config,
    eos_config,
    owns_all,
    publish,
    statuses,
    wait_for,
)
from tests.relay_helpers import looping

pytestmark = pytest.mark.integration


class HangingTakeOvers(StubPublisher):
    """The first take-over ends at once; later ones wait until ``release`` is set, as
    ``init_transactions`` does on a transaction coordinator that does not answer."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.hanging = threading.Event()
        self.release = threading.Event()

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        self.calls += 1
        if self.calls > 1:
            self.hanging.set()
            self.release.wait(60)
        return []


def pending_by_shard(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT shard, count(*) FROM outbox WHERE status = 'pending' GROUP BY shard")
        )
        return {int(shard): int(count) for shard, count in rows}


def test_a_take_over_that_does_not_end_holds_only_its_own_shards(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    """Taken over inside the loop, one hanging take-over held every shard's messages for as
    long as it hung (a minute per shard with init_transactions(60)). In the background, the
    shards already owned go on; the gained ones are read only once it ended (no send before
    the progress is recovered), and the relay's health says which is wedged."""
    stub = HangingTakeOvers()
    relay = Relay(eos_config(outbox_url), publisher=stub)
    try:
        with looping(relay):
            wait_for(lambda: owns_all(relay))
            # A second relay takes half the shards, then stops: the first one gains them back,
            # and that take-over hangs.
            with looping(Relay(eos_config(outbox_url), publisher=StubPublisher())):
                wait_for(lambda: len(relay._ownership.owned) == SHARD_COUNT // 2)  # type: ignore[union-attr]
            kept = set(relay._ownership.owned)  # type: ignore[union-attr]
            wait_for(lambda: stub.hanging.is_set())
            relay.health.stale_after = 3.0
            publish(engine, 400, keys=100)  # every shard gets some
            began = time.monotonic()
            wait_for(lambda: not kept & set(pending_by_shard(engine)), 10)
            kept_sent_in = time.monotonic() - began
            gained = set(range(SHARD_COUNT)) - kept
            assert set(pending_by_shard(engine)) == gained  # untouched until taken over
            assert relay.health.alive  # the loop turns, the shards it can serve go on
            wait_for(lambda: not relay.health.alive, 10)
            assert "wedged" in relay.health.not_alive_because()
            stub.release.set()
            wait_for(lambda: statuses(engine) == {"sent": 400})
            assert relay.health.alive
    finally:
        stub.release.set()
    assert len(stub.acked) == 400 and by_key_in_seq_order(stub.acked)
    print(f"shards already owned sent within {kept_sent_in:.2f}s beside a hanging take-over")


def test_a_batch_that_never_ends_makes_the_relay_not_alive(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    """One shard's batch never ends while the others' go: the loop turns and the other
    batches progress, so neither "stalled" nor "stuck" saw it (a chaos run met a relay
    answering ok for 286 s while its shard waited)."""

    class OneShardHangs(StubPublisher):
        """A batch per shard (as exactly-once sends them); shard 0's never ends."""

        hang = True

        def start(self, records: Sequence[OutboxRecord]) -> list[InFlight]:
            flights: list[InFlight] = []
            for shard in sorted({r.shard for r in records}):
                flights += super().start([r for r in records if r.shard == shard])
            return flights

        def wait(self, timeout: float) -> list:  # type: ignore[type-arg]
            ended = super().wait(timeout)
            held = [f for f in ended if self.hang and any(r.shard == 0 for r in f.records)]
            for flight in held:  # never reported ended: in flight for good
                ended.remove(flight)
                self.flights.append(flight)
                flight.ends_at = float("inf")
            return ended

        def let_it_end(self) -> None:
            self.hang = False
            for flight in self.flights:
                flight.ends_at = min(flight.ends_at, time.monotonic())

    stub = OneShardHangs()
    relay = Relay(config(outbox_url), publisher=stub)
    with looping(relay):
        try:
            wait_for(lambda: owns_all(relay))
            relay.health.stale_after = 2.0
            publish(engine, 400, keys=100)
            wait_for(lambda: set(pending_by_shard(engine)) == {0}, 10)
            deadline = time.monotonic() + 10
            while relay.health.alive and time.monotonic() < deadline:
                publish(engine, 20, keys=20)  # the other shards keep progressing
                time.sleep(0.2)
            assert not relay.health.alive
            assert "wedged" in relay.health.not_alive_because()
        finally:
            stub.let_it_end()  # (the shutdown waits for it)


def test_a_mark_waiting_for_an_operators_row_lock_makes_the_relay_not_alive(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    """An operator's open transaction holds a row lock the relay's mark needs: the mark waits
    (the relay's sessions set no lock_timeout), the row's shard with it, while the loop turns.
    The relay answered alive for as long; now it says it is wedged, so that a supervisor
    restarts it, and once the lock goes the mark ends and it is alive again."""
    [row_id] = publish(engine, 1, keys=1)
    stub = StubPublisher()
    relay = Relay(config(outbox_url), publisher=stub)
    relay.health.stale_after = 2.0
    with engine.connect() as operator:
        operator.execute(sa.text("SELECT id FROM outbox WHERE id = :id FOR UPDATE"), {"id": row_id})
        with looping(relay):
            wait_for(lambda: [r.id for r in stub.acked] == [row_id])
            wait_for(lambda: not relay.health.alive, 10)
            assert "wedged" in relay.health.not_alive_because()
            assert statuses(engine) == {"pending": 1}
            operator.rollback()
            wait_for(lambda: statuses(engine) == {"sent": 1})
            wait_for(lambda: relay.health.alive, 10)


def test_a_mark_waiting_for_a_row_lock_is_wedged_after_the_wedge_timeout(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    """A mark has a bound of its own (``--wedge-timeout``), far below the liveness bound of a
    batch on its way to Kafka (the delivery timeout and more: six minutes by default), so a
    mark blocked on an operator's row lock turns /healthz bad within the stated bound."""
    [row_id] = publish(engine, 1, keys=1)
    stub = StubPublisher()
    relay = Relay(config(outbox_url, wedge_timeout=1.0), publisher=stub)
    assert relay.health.stale_after >= 300  # the default delivery timeout's bound, untouched
    with engine.connect() as operator:
        operator.execute(sa.text("SELECT id FROM outbox WHERE id = :id FOR UPDATE"), {"id": row_id})
        with looping(relay):
            wait_for(lambda: [r.id for r in stub.acked] == [row_id])
            acked = time.monotonic()
            wait_for(lambda: not relay.health.alive, 60)
            took = time.monotonic() - acked
            assert relay.health.not_alive_because() == (
                "wedged: a mark or take-over of its shards has not ended for 1s"
            )
            assert took < 60  # the wedge timeout's 1 s and the loop's turns, not 300 s and more
            assert statuses(engine) == {"pending": 1}
            operator.rollback()
            wait_for(lambda: statuses(engine) == {"sent": 1})
            wait_for(lambda: relay.health.alive, 10)
    print(f"/healthz wedged {took:.2f}s after the ack (wedge timeout 1 s)")


def test_a_take_over_that_does_not_end_is_wedged_after_the_wedge_timeout(  # type: ignore[no-untyped-def]
    outbox_url,
) -> None:
    stub = HangingTakeOvers()
    relay = Relay(config(outbox_url, mode="exactly-once", wedge_timeout=1.0), publisher=stub)
    assert relay.health.stale_after >= 300
    try:
        with looping(relay):
            wait_for(lambda: owns_all(relay))
            # A second relay takes half the shards, then stops: the first one gains them back,
            # and that take-over hangs.
            with looping(Relay(eos_config(outbox_url), publisher=StubPublisher())):
                wait_for(lambda: len(relay._ownership.owned) == SHARD_COUNT // 2)  # type: ignore[union-attr]
            wait_for(lambda: stub.hanging.is_set())
            hanging = time.monotonic()
            wait_for(lambda: not relay.health.alive, 60)
            assert time.monotonic() - hanging < 60  # not the liveness bound's 300 s and more
            assert relay.health.not_alive_because() == (
                "wedged: a mark or take-over of its shards has not ended for 1s"
            )
            stub.release.set()
            wait_for(lambda: relay.health.alive, 10)
    finally:
        stub.release.set()


def test_a_failure_mark_waiting_for_a_row_lock_is_wedged_after_the_wedge_timeout(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    """A failed row is recorded by the loop itself, in a transaction: blocked on a row lock,
    the loop does not turn, and only the liveness bound (minutes) noticed; the mark's own
    bound does now."""
    [row_id] = publish(engine, 1, keys=1)
    stub = StubPublisher()
    stub.decide = lambda record: "dead"
    relay = Relay(config(outbox_url, wedge_timeout=1.0), publisher=stub)
    with engine.connect() as operator:
        operator.execute(sa.text("SELECT id FROM outbox WHERE id = :id FOR UPDATE"), {"id": row_id})
        with looping(relay):
            wait_for(lambda: len(stub.flights) == 1)
            started = time.monotonic()
            wait_for(lambda: not relay.health.alive, 60)
            assert time.monotonic() - started < 60  # not the liveness bound's 300 s and more
            assert relay.health.not_alive_because() == (
                "wedged: a mark or take-over of its shards has not ended for 1s"
            )
            assert statuses(engine) == {"pending": 1}
            operator.rollback()
            wait_for(lambda: statuses(engine) == {"dead": 1})
            wait_for(lambda: relay.health.alive, 10)
