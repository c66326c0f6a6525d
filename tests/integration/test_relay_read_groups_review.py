"""The read's groups against shards with a backlog while another shard is busy: exactly-once
reads each shard as a group of its own, at-least-once four groups. Real PostgreSQL, the loop
with a stub publisher that, like ExactlyOncePublisher, runs one flight per shard.

A cold review found that, behind a backlog with a batch in flight, a read took only the idle
shards of the cursor's group, even when they held nothing and another idle shard held a
backlog; the cursor moved one group per read, and an empty read made the loop wait for the
next event (up to WAIT_SLICE). With a group per shard an idle backlogged shard waited up to
about 3 s per batch (four groups: 0.6 s). A group that holds nothing is now followed at once
by the other idle shards, a quarter of the owned shards at a time, in both modes."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.engines import sender_engine
from outbox.records import OutboxRecord
from outbox.relay.daemon import Relay
from outbox.relay.producers import InFlight
from outbox.relay.store import PendingRow, RelayStore
from outbox.schema import OutboxTableSpec
from outbox.sending import Ack
from tests.integration.test_relay_loop import StubFlight, by_key_in_seq_order, config, wait_for
from tests.relay_helpers import looping

pytestmark = pytest.mark.integration

#: Every case runs with four groups (at-least-once's) and a group per shard (exactly-once's).
EACH_GROUPING = pytest.mark.parametrize(
    "groups",
    [pytest.param(4, id="four-groups"), pytest.param(None, id="exactly-once-default")],
)

#: Keys and their shards (crc32(key) % 16).
SLOW_KEY, SLOW_SHARD = "hot-3", 1
HOT_KEY, HOT_SHARD = "hot-9", 15
OTHER_KEY, OTHER_SHARD = "hot-6", 14


class PerShardStub:
    """One flight per shard of each start (as ExactlyOncePublisher: a transaction per shard),
    each acknowledged ``latency`` (per shard, else ``default``) seconds after it started."""

    def __init__(self, default: float = 0.02, latency: dict[int, float] | None = None) -> None:
        self.default = default
        self.latency = latency or {}
        self.flights: list[StubFlight] = []
        self.acked: list[OutboxRecord] = []
        #: (time, "start" | "end", shard, rows)
        self.log: list[tuple[float, str, int, int]] = []
        self.in_flight_shards: set[int] = set()
        self.offsets = 0

    def check_reachable(self, timeout: float) -> None:
        return None

    def serve_events(self) -> None:
        return None

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        return []

    def let_go(self, shards: Sequence[int]) -> None:
        return None

    def start(self, records: Sequence[OutboxRecord]) -> list[InFlight]:
        by_shard: dict[int, list[OutboxRecord]] = {}
        for record in records:
            by_shard.setdefault(record.shard, []).append(record)
        now = time.monotonic()
        flights: list[InFlight] = []
        for shard, batch in by_shard.items():
            assert shard not in self.in_flight_shards, "a shard had two batches in flight"
            self.in_flight_shards.add(shard)
            flight = StubFlight(batch, ends_at=now + self.latency.get(shard, self.default))
            self.flights.append(flight)
            flights.append(flight)
            self.log.append((now, "start", shard, len(batch)))
        return flights

    def wait(self, timeout: float) -> list[InFlight]:
        if self.flights:
            time.sleep(
                max(0.0, min(timeout, min(f.ends_at for f in self.flights) - time.monotonic()))
            )
        else:
            time.sleep(timeout)
        now = time.monotonic()
        ended = [f for f in self.flights if f.ends_at <= now]
        for flight in ended:
            for record in flight.records:
                self.offsets += 1
                flight.result.acks.append(Ack(record.id, 0, self.offsets, record.generation))
                self.acked.append(record)
            flight.ended = True
            shard = flight.records[0].shard
            self.in_flight_shards.discard(shard)
            self.log.append((now, "end", shard, len(flight.records)))
            self.flights.remove(flight)
        return list(ended)

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    def stop_sending(self) -> None:
        return None

    def close(self) -> None:
        return None

    def starts(self, shard: int) -> list[float]:
        return [t for t, what, s, _ in self.log if what == "start" and s == shard]

    def ends(self, shard: int) -> list[float]:
        return [t for t, what, s, _ in self.log if what == "end" and s == shard]


class CountingStore(RelayStore):
    """Counts the reads (SQL statements) and how many of them found nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.reads = 0
        self.empty_reads = 0
        self.marks = 0
        #: The most rows one read returned, in all and of one shard.
        self.largest_read = 0
        self.largest_of_one_shard = 0

    def mark_acked(self, acks, connection, owner_key):  # type: ignore[no-untyped-def,override]
        self.marks += 1
        return super().mark_acked(acks, connection, owner_key)

    def read_batch(self, shards, batch_size, connection=None, per_shard=None, owner_key=None):  # type: ignore[no-untyped-def,override]
        rows: list[PendingRow] = super().read_batch(
            shards, batch_size, connection, per_shard, owner_key
        )
        self.reads += 1
        self.empty_reads += not rows
        self.largest_read = max(self.largest_read, len(rows))
        of_one = max(Counter(row.shard for row in rows).values(), default=0)
        self.largest_of_one_shard = max(self.largest_of_one_shard, of_one)
        return rows


def publish_key(engine: sa.Engine, key: str, count: int) -> None:
    for start in range(0, count, 500):
        with Outbox(engine).transaction() as tx:
            tx.publish_many(
                [
                    Message("eo-groups", {"n": n}, key=key)
                    for n in range(start, min(count, start + 500))
                ]
            )


def shard_of_key(engine: sa.Engine, key: str) -> int:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT DISTINCT shard FROM outbox WHERE key = convert_to(:k, 'UTF8')"),
            {"k": key},
        ).scalar_one()


@contextmanager
def counting_relay(
    outbox_url: str, stub: PerShardStub, groups: int | None, mode: str = "exactly-once"
) -> Iterator[Relay]:
    store = CountingStore(sender_engine(outbox_url), OutboxTableSpec(), "counting")
    relay = Relay(config(outbox_url, mode=mode, batch_size=50), publisher=stub, store=store)
    relay.read_groups = groups
    try:
        yield relay
    finally:
        store.engine.dispose()


def pending(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT count(*) FROM outbox WHERE status = 'pending'")
        ).scalar_one()


@EACH_GROUPING
def test_a_backlogged_shard_keeps_going_while_another_shards_transaction_is_long(  # type: ignore[no-untyped-def]
    engine, outbox_url, groups
) -> None:
    """One shard's transaction takes 5 s (a slow partition leader, a commit resumed); another
    shard holds 40 batches, each acknowledged in 20 ms: the backlogged shard's batches follow
    one another, whatever the groups (the cursor's turns once left it idle up to 3 s)."""
    publish_key(engine, SLOW_KEY, 1)
    publish_key(engine, HOT_KEY, 2000)
    assert shard_of_key(engine, SLOW_KEY) == SLOW_SHARD
    assert shard_of_key(engine, HOT_KEY) == HOT_SHARD
    stub = PerShardStub(default=0.02, latency={SLOW_SHARD: 5.0})
    with counting_relay(outbox_url, stub, groups) as relay, looping(relay):
        wait_for(lambda: len(stub.ends(SLOW_SHARD)) >= 1, timeout=30)
    slow_began, slow_ended = stub.starts(SLOW_SHARD)[0], stub.ends(SLOW_SHARD)[0]
    hot = [t for t in stub.starts(HOT_SHARD) if slow_began <= t <= slow_ended]
    gaps = [
        start - end
        for end, start in zip(stub.ends(HOT_SHARD), stub.starts(HOT_SHARD)[1:], strict=False)
        if slow_began <= start <= slow_ended
    ]
    print(
        f"groups={groups}: {len(hot)} hot batches during the 5 s transaction; "
        f"idle gaps max {max(gaps, default=0):.2f}s mean "
        f"{sum(gaps) / max(1, len(gaps)):.2f}s; reads {relay.store.reads} "  # type: ignore[attr-defined]
        f"(empty {relay.store.empty_reads})"  # type: ignore[attr-defined]
    )
    assert by_key_in_seq_order(stub.acked)
    assert len(hot) >= 8, f"{len(hot)} batches of the backlogged shard in 5 s (40 waiting)"


def overlapped_starts(stub: PerShardStub, shard: int, other: int) -> tuple[int, int]:
    """How many of ``shard``'s batches started while ``other`` had one in flight, of all."""
    busy, overlapped, total = False, 0, 0
    for _, what, s, _ in stub.log:
        if s == other:
            busy = what == "start"
        elif s == shard and what == "start":
            total += 1
            overlapped += busy
    return overlapped, total


@EACH_GROUPING
def test_two_backlogged_shards_go_side_by_side(  # type: ignore[no-untyped-def]
    engine, outbox_url, groups
) -> None:
    """Two shards (1 and 14) hold 40 batches each, each acknowledged in 30 ms; the others are
    empty (two hot keys). Their batches should mostly be in flight side by side (four groups:
    about 30 of the 80 starts made while the other shard's batch was in flight)."""
    publish_key(engine, SLOW_KEY, 2000)
    publish_key(engine, OTHER_KEY, 2000)
    stub = PerShardStub(default=0.03)
    with counting_relay(outbox_url, stub, groups) as relay, looping(relay):
        began = time.monotonic()
        wait_for(lambda: len(stub.acked) >= 4000, timeout=60)
        took = time.monotonic() - began
    a = overlapped_starts(stub, SLOW_SHARD, OTHER_SHARD)
    b = overlapped_starts(stub, OTHER_SHARD, SLOW_SHARD)
    print(
        f"groups={groups}: drained 2x2000 in {took:.2f}s; starts beside the other: "
        f"shard {SLOW_SHARD} {a}, shard {OTHER_SHARD} {b}; reads {relay.store.reads} "  # type: ignore[attr-defined]
        f"(empty {relay.store.empty_reads})"  # type: ignore[attr-defined]
    )
    assert by_key_in_seq_order(stub.acked)
    assert a[0] + b[0] >= 15, f"{a[0] + b[0]} of 80 starts beside the other shard's batch"


@EACH_GROUPING
def test_reads_per_batch_of_one_deep_shard(  # type: ignore[no-untyped-def]
    engine, outbox_url, groups
) -> None:
    """One shard (15) holds 40 batches, the others nothing: SQL reads per batch sent."""
    publish_key(engine, HOT_KEY, 2000)
    stub = PerShardStub(default=0.02)
    with counting_relay(outbox_url, stub, groups) as relay, looping(relay):
        began = time.monotonic()
        wait_for(lambda: len(stub.acked) >= 2000, timeout=60)
        took = time.monotonic() - began
        reads, empty = relay.store.reads, relay.store.empty_reads  # type: ignore[attr-defined]
    batches = len(stub.starts(HOT_SHARD))
    print(
        f"groups={groups}: {batches} batches in {took:.2f}s, {reads} reads ({empty} empty): "
        f"{reads / batches:.1f} reads a batch"
    )
    assert by_key_in_seq_order(stub.acked)
    assert reads / batches <= 8, f"{reads / batches:.1f} SQL reads a batch"


@EACH_GROUPING
def test_a_uniform_backlog_drains_in_key_order(engine, outbox_url, groups) -> None:  # type: ignore[no-untyped-def]
    """8,000 rows over 200 keys (every shard) drain in key order (drain time, reads and marks
    printed)."""
    with Outbox(engine).transaction() as tx:
        tx.publish_many([Message("eo-groups", {"n": n}, key=f"u{n % 200}") for n in range(8000)])
    stub = PerShardStub(default=0.02)
    with counting_relay(outbox_url, stub, groups) as relay, looping(relay):
        began = time.monotonic()
        wait_for(lambda: len(stub.acked) >= 8000, timeout=120)
        took = time.monotonic() - began
        store = relay.store
    print(
        f"groups={groups}: 8000 rows in {took:.2f}s, {sum(1 for e in stub.log if e[1] == 'start')}"
        f" batches, {store.reads} reads ({store.empty_reads} empty), {store.marks} marks"  # type: ignore[attr-defined]
    )
    assert by_key_in_seq_order(stub.acked)


@EACH_GROUPING
@pytest.mark.serial  # a wall-clock bound: run alone
def test_a_new_row_goes_at_once_while_one_shards_transaction_is_long(  # type: ignore[no-untyped-def]
    engine, outbox_url, groups
) -> None:
    """Shard 1's transaction takes 12 s, shard 15 holds a backlog; one at a time, a new row
    is committed to each of six quiet shards: each is sent within a loop step or two, not
    after the groups' turns came round (1.9-2.8 s with a group per shard before)."""
    publish_key(engine, SLOW_KEY, 1)
    publish_key(engine, HOT_KEY, 20000)
    stub = PerShardStub(default=0.02, latency={SLOW_SHARD: 12.0})
    quiet = ["hot-32", "hot-4", "hot-5", "hot-2", "hot-8", "hot-18"]  # shards 0 2 4 7 9 12
    waits = []
    with counting_relay(outbox_url, stub, groups) as relay, looping(relay):
        wait_for(lambda: len(stub.starts(SLOW_SHARD)) >= 1, timeout=30)
        time.sleep(0.3)
        for key in quiet:
            publish_key(engine, key, 1)
            began = time.monotonic()
            wanted = key.encode()
            wait_for(lambda k=wanted: any(r.key == k for r in stub.acked), timeout=30)
            waits.append(time.monotonic() - began)
        assert not stub.ends(SLOW_SHARD), "the long transaction ended before the last row"
    print(f"groups={groups}: new rows sent after " + ", ".join(f"{w:.2f}s" for w in waits))
    assert max(waits) < 1.0, f"a new row on a quiet shard waited {max(waits):.2f}s"


@EACH_GROUPING
def test_a_backlogged_shard_keeps_going_beside_a_mark_held_by_a_row_lock(  # type: ignore[no-untyped-def]
    engine, outbox_url, groups
) -> None:
    """Another transaction holds the row of shard 1 locked (an operator's SELECT ... FOR
    UPDATE): its mark waits, its shard stays busy. Shard 15 holds 80 batches, each
    acknowledged in 20 ms: it should go on at well over a batch a second."""
    from tests.integration.test_relay_row_locks import LOCKS, row_locked

    publish_key(engine, SLOW_KEY, 1)
    publish_key(engine, HOT_KEY, 4000)
    with engine.connect() as conn:
        (locked,) = conn.execute(
            sa.text("SELECT id FROM outbox WHERE key = convert_to(:k, 'UTF8')"), {"k": SLOW_KEY}
        ).one()
    stub = PerShardStub(default=0.02)
    with counting_relay(outbox_url, stub, groups) as relay, ExitStack() as lock:
        # Locked before the relay reads it, let go before the relay stops (its shutdown
        # would wait for the held mark).
        lock.enter_context(row_locked(outbox_url, locked, LOCKS["select for update"]))
        with looping(relay):
            try:
                wait_for(lambda: relay.metrics.marks_blocked._value.get() >= 1, timeout=30)
                began = time.monotonic()
                time.sleep(5)
                hot = [t for t in stub.starts(HOT_SHARD) if t >= began]
            finally:
                lock.close()
    print(f"groups={groups}: {len(hot)} batches of shard {HOT_SHARD} in 5 s beside the held mark")
    assert by_key_in_seq_order(stub.acked)
    assert len(hot) >= 8, f"{len(hot)} batches of the backlogged shard in 5 s (80 waiting)"
