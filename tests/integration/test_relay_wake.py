"""Writers never pay for the relays' shape: they notify only while every relay that could
serve their commit is asleep, whatever the number of relays and whether they are busy, idle
or own no shard. Real relay loops on a real PostgreSQL, with the stub publisher standing in
for Kafka."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.relay.daemon import Relay
from outbox.schema import DEFAULT_SPEC, SHARD_COUNT, shard_of
from tests.integration.test_relay_loop import StubPublisher, config, statuses, wait_for
from tests.relay_helpers import looping

pytestmark = pytest.mark.integration

CHANNEL = DEFAULT_SPEC.notify_channel


def conninfo(outbox_url: str) -> str:
    url = sa.make_url(outbox_url).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


def key_in(shards: set[int]) -> str:
    """A message key whose shard is one of ``shards``."""
    for n in range(10_000):
        if shard_of(f"k{n}".encode(), uuid.uuid4()) in shards:
            return f"k{n}"
    raise AssertionError("no key found")


def publish_one(engine: sa.Engine, key: str) -> uuid.UUID:
    with Outbox(engine).transaction() as tx:
        return tx.publish_many([Message("wake", {"k": key}, key=key)])[0].message_id


def writer_notifies(listener: psycopg.Connection, timeout: float) -> int:
    """NOTIFYs from writers (a relay's own carry a payload, 'relay' or 'working')."""
    return sum(1 for n in listener.notifies(timeout=timeout) if n.payload == "")


@contextmanager
def listening(outbox_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(conninfo(outbox_url), autocommit=True) as conn:
        conn.execute(f'LISTEN "{CHANNEL}"')
        yield conn


@contextmanager
def every_shard_held_elsewhere(outbox_url: str) -> Iterator[None]:
    """A session that is a member and holds every shard's lock, as a relay owning them all
    does: a relay that joins then owns none."""
    spec = DEFAULT_SPEC
    with psycopg.connect(conninfo(outbox_url), autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s, 1)", (spec.lock_space("member"),))
        for shard in range(SHARD_COUNT):
            conn.execute("SELECT pg_advisory_lock(%s, %s)", (spec.lock_space("shard"), shard))
        yield


def holds_a_wake_lock(engine: sa.Engine, relay: Relay) -> bool:
    assert relay._conn is not None
    with engine.connect() as conn:
        pids = conn.execute(
            sa.text(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND objsubid = 2 AND classid = CAST(CAST(:space AS bigint) AS oid)"
            ),
            {"space": DEFAULT_SPEC.wake_lock[0]},
        ).scalars()
        return relay._conn.info.backend_pid in set(pids)


def test_a_relay_that_owns_no_shard_never_makes_writers_notify(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    """With 16 shards, 5, 7 or 9-15 relays leave one relay without a shard: idle for ever, it
    must not take the watch and the wake lock, or every writer notifies at every commit."""
    relay = Relay(config(outbox_url, poll_interval=5.0), publisher=StubPublisher())
    with every_shard_held_elsewhere(outbox_url), listening(outbox_url) as listener, looping(relay):
        wait_for(lambda: relay._ownership is not None and relay._ownership.joined)
        time.sleep(0.5)  # several turns of its loop, idle
        assert relay._ownership is not None and not relay._ownership.owned
        for _ in range(5):
            publish_one(engine, "k")
        assert writer_notifies(listener, 0.5) == 0
        assert not holds_a_wake_lock(engine, relay)


def test_an_idle_relay_beside_a_busy_one_neither_makes_writers_notify_nor_waits_its_poll(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    """One relay's batch is in flight for seconds (busy); the other has nothing to do. A
    commit then notifies nobody, and the idle relay still sends a row of its shards at once,
    far below its 5 s poll interval."""
    slow, quick = StubPublisher(latency=4.0), StubPublisher(latency=0.005)
    busy = Relay(config(outbox_url, poll_interval=5.0), publisher=slow)
    idle = Relay(config(outbox_url, poll_interval=5.0), publisher=quick)
    with looping(busy), looping(idle), listening(outbox_url) as listener:

        def owned(relay: Relay) -> set[int]:
            return set(relay._ownership.owned) if relay._ownership is not None else set()

        wait_for(lambda: len(owned(busy)) == len(owned(idle)) == SHARD_COUNT // 2)
        publish_one(engine, key_in(owned(busy)))  # the busy relay's batch, for 4 s
        wait_for(lambda: slow.in_flight == 1, 5)
        time.sleep(0.5)  # both loops turn: one busy, one idle
        for _ in listener.notifies(timeout=0):
            pass
        started = time.monotonic()
        row = publish_one(engine, key_in(owned(idle)))
        wait_for(lambda: any(r.id == row for r in quick.acked), 3)
        picked_up = time.monotonic() - started
        assert writer_notifies(listener, 0.3) == 0
        assert slow.in_flight == 1  # still busy all along
        print(f"row of the idle relay's shard sent after {picked_up * 1000:.1f} ms")
        assert picked_up < 1.0, picked_up  # the poll interval is 5 s
    assert statuses(engine) == {"sent": 2}


def hold_rows(engine: sa.Engine, key: str, count: int) -> None:
    """``count`` pending rows of ``key`` leased to an immediate sender for an hour, as rows
    it wrote and still sends are."""
    shard = shard_of(key.encode(), uuid.uuid4())
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox (id, shard, topic, key, value, lease_owner, lease_until) "
                "SELECT gen_random_uuid(), :shard, 'wake', convert_to(:key, 'UTF8'), "
                "convert_to('held ' || g, 'UTF8'), 'immediate-elsewhere', "
                "now() + interval '1 hour' FROM generate_series(1, :count) AS g"
            ),
            {"shard": shard, "key": key, "count": count},
        )


def test_rows_held_by_the_immediate_sender_never_hide_a_free_row_behind_them(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    """2,000 held rows at the head of a shard, far more than its read window: a row of another
    key behind them goes at once (the poll interval is 5 s, and nothing wakes the relay when
    leases end), and a later row of the held key waits for it, in order."""
    stub = StubPublisher(latency=0.005)
    relay = Relay(config(outbox_url, poll_interval=5.0, rebalance_interval=5.0), publisher=stub)
    held_key = "k0"
    shard = shard_of(held_key.encode(), uuid.uuid4())
    free_key = next(
        f"f{n}" for n in range(10_000) if shard_of(f"f{n}".encode(), uuid.uuid4()) == shard
    )
    with looping(relay):
        wait_for(lambda: relay._ownership is not None and len(relay._ownership.owned) == 16)
        hold_rows(engine, held_key, 2000)
        behind_held = publish_one(engine, held_key)
        time.sleep(0.3)  # the relay has looked, found nothing it may send, and sleeps
        started = time.monotonic()
        free = publish_one(engine, free_key)
        wait_for(lambda: any(r.id == free for r in stub.acked), 3)
        picked_up = time.monotonic() - started
        time.sleep(0.3)
    print(f"free row behind 2,000 held ones sent after {picked_up * 1000:.1f} ms")
    assert picked_up < 1.0, picked_up  # far below the poll interval
    assert behind_held not in {r.id for r in stub.acked}  # its key's held rows go first
    assert statuses(engine) == {"pending": 2001, "sent": 1}
