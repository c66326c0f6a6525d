"""Writers never pay for the relays' shape: they notify only while every relay that could
serve their commit is asleep, whatever the number of relays and whether they are busy, idle
or own no shard. Real relay loops on a real PostgreSQL, with the stub sender standing in
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
from tests.integration.test_relay_wakeups import TimedStub
from tests.relay_helpers import looping, statuses, wait_for
from tests.stub_sender import StubSender, stub_config, stub_relay

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


def advisory_locks(engine: sa.Engine, relay: Relay) -> set[tuple[int, int]]:
    """The advisory locks (space, key) the relay's sessions hold (each session is named after
    the relay: its ``application_name`` starts with ``relay.owner``)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT l.classid::bigint, l.objid::bigint FROM pg_locks AS l "
                "JOIN pg_stat_activity AS a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 "
                "AND starts_with(a.application_name, :owner)"
            ),
            {"owner": relay.owner},
        )
        return {(space, key) for space, key in rows}


def joined(engine: sa.Engine, relay: Relay) -> bool:
    """The relay is a member (it holds a member lock): it counts in the others' shares."""
    member = DEFAULT_SPEC.lock_space("member")
    return any(space == member for space, _ in advisory_locks(engine, relay))


def holds_a_wake_lock(engine: sa.Engine, relay: Relay) -> bool:
    """The relay holds a lock of the wake-up handshake: the wake lock (writers notify), the
    sleeper lock (it watches for the idle relays) or the work lock."""
    wake_space = DEFAULT_SPEC.wake_lock[0]
    return any(space == wake_space for space, _ in advisory_locks(engine, relay))


def test_a_relay_that_owns_no_shard_never_makes_writers_notify(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    """With 16 shards, 5, 7 or 9-15 relays leave one relay without a shard: idle for ever, it
    must not take the watch and the wake lock, or every writer notifies at every commit."""
    relay = stub_relay(stub_config(outbox_url, poll_interval=5.0), StubSender())
    with every_shard_held_elsewhere(outbox_url), listening(outbox_url) as listener, looping(relay):
        wait_for(lambda: joined(engine, relay), 20, "the relay to join the members")
        time.sleep(0.5)  # several turns of its loop, idle
        assert not relay.owned_shards
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
    slow, quick = StubSender(latency=4.0), TimedStub(latency=0.005)
    busy = stub_relay(stub_config(outbox_url, poll_interval=5.0), slow)
    idle = stub_relay(stub_config(outbox_url, poll_interval=5.0), quick)
    with looping(busy), looping(idle), listening(outbox_url) as listener:
        wait_for(
            lambda: len(busy.owned_shards) == len(idle.owned_shards) == SHARD_COUNT // 2,
            20,
            "the relays to share the shards",
        )
        publish_one(engine, key_in(set(busy.owned_shards)))  # the busy relay's batch, for 4 s
        wait_for(lambda: slow.in_flight == 1, 5, "the busy relay's batch in flight")
        time.sleep(0.5)  # both loops turn: one busy, one idle
        for _ in listener.notifies(timeout=0):
            pass
        started = time.monotonic()
        row = publish_one(engine, key_in(set(idle.owned_shards)))
        wait_for(lambda: row in quick.acked_ids(), 3, "the idle relay's row sent")
        picked_up = quick.sent_at[row] - started
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
    stub = TimedStub(latency=0.005)
    relay = stub_relay(stub_config(outbox_url, poll_interval=5.0, rebalance_interval=5.0), stub)
    held_key = "k0"
    shard = shard_of(held_key.encode(), uuid.uuid4())
    free_key = next(
        f"f{n}" for n in range(10_000) if shard_of(f"f{n}".encode(), uuid.uuid4()) == shard
    )
    with looping(relay):
        wait_for(lambda: len(relay.owned_shards) == SHARD_COUNT, 30, "the relay to own all")
        hold_rows(engine, held_key, 2000)
        behind_held = publish_one(engine, held_key)
        time.sleep(0.3)  # the relay has looked, found nothing it may send, and sleeps
        started = time.monotonic()
        free = publish_one(engine, free_key)
        wait_for(lambda: free in stub.acked_ids(), 3, "the free row sent")
        picked_up = stub.sent_at[free] - started
        time.sleep(0.3)
    print(f"free row behind 2,000 held ones sent after {picked_up * 1000:.1f} ms")
    assert picked_up < 1.0, picked_up  # far below the poll interval
    assert behind_held not in {r.id for r in stub.acked}  # its key's held rows go first
    assert statuses(engine) == {"pending": 2001, "sent": 1}
