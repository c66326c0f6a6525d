"""The commit-time wake-up: writers notify only while a relay sleeps, on every write path,
only for committed rows, and no commit slips between a relay's last look and its sleep."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox
from outbox import Message, Outbox
from outbox.relay.wakeup import WakeUp
from outbox.schema import DEFAULT_SPEC

pytestmark = pytest.mark.integration

CHANNEL = DEFAULT_SPEC.notify_channel


def conninfo(engine: sa.Engine) -> str:
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


def writer_notifies(listener: psycopg.Connection, timeout: float) -> list[str]:
    """Notifications from writers (a relay's own carry the payload 'relay')."""
    return [
        n.channel for n in listener.notifies(timeout=timeout, stop_after=1) if n.payload != "relay"
    ]


@pytest.fixture
def relay_conn(engine: sa.Engine) -> Iterator[psycopg.Connection]:
    """An autocommit connection listening on the channel, as a relay's is."""
    with psycopg.connect(conninfo(engine), autocommit=True) as conn:
        conn.execute(f'LISTEN "{CHANNEL}"')
        yield conn


def fall_asleep(conn: psycopg.Connection) -> WakeUp:
    """A relay with nothing to do: it takes the watch and the wake lock, then drains its own
    notification."""
    wake = WakeUp(conn, DEFAULT_SPEC)
    wake.idle(0.01)
    assert wake.watching and wake.asleep
    for _ in conn.notifies(timeout=0.2):
        pass
    return wake


def test_no_relay_asleep_no_notify(engine: sa.Engine, relay_conn: psycopg.Connection) -> None:
    with Outbox(engine).transaction() as tx:
        tx.publish("orders", b"1")
    assert writer_notifies(relay_conn, 0.5) == []


def test_a_sleeping_relay_hears_of_commits_only(
    engine: sa.Engine, relay_conn: psycopg.Connection
) -> None:
    fall_asleep(relay_conn)
    ob = Outbox(engine)
    with ob.transaction() as tx:
        tx.publish("orders", b"1")
        tx.publish("orders", b"2")
        assert writer_notifies(relay_conn, 0.3) == []  # inserted, not yet committed
    assert writer_notifies(relay_conn, 5) == [CHANNEL]
    assert writer_notifies(relay_conn, 0.3) == []  # repeats within one transaction fold
    with pytest.raises(RuntimeError), ob.transaction() as tx:
        tx.publish("orders", b"3")
        raise RuntimeError("business failure")
    assert writer_notifies(relay_conn, 0.5) == []


def test_a_busy_relay_lets_writers_commit_without_notifying(
    engine: sa.Engine, relay_conn: psycopg.Connection
) -> None:
    wake = fall_asleep(relay_conn)
    wake.busy()
    assert not wake.watching and not wake.asleep
    with Outbox(engine).transaction() as tx:
        tx.publish("orders", b"1")
    assert writer_notifies(relay_conn, 0.5) == []


@pytest.mark.serial
def test_a_relay_does_not_fall_asleep_while_a_writer_that_did_not_notify_is_open(
    engine: sa.Engine, relay_conn: psycopg.Connection
) -> None:
    ob = Outbox(engine)
    with ob.transaction() as tx:
        tx.publish("orders", b"1")  # no relay asleep: this writer will not notify
        wake = WakeUp(relay_conn, DEFAULT_SPEC)
        started = time.monotonic()
        woken = wake.idle(5.0)
        assert wake.watching and not wake.asleep  # the writer holds the wake lock shared
        assert not woken and time.monotonic() - started < 1.0  # a short pause, not a sleep
    wake.idle(5.0)  # committed: now the lock is free
    assert wake.asleep


def test_falling_asleep_makes_every_relay_look_once_more(engine: sa.Engine) -> None:
    """Rows committed before the wake lock was taken sent no NOTIFY: the relay that takes it
    wakes every relay (itself too) for a last look, and hands the watch over when it leaves."""
    with (
        psycopg.connect(conninfo(engine), autocommit=True) as first,
        psycopg.connect(conninfo(engine), autocommit=True) as second,
    ):
        for conn in (first, second):
            conn.execute(f'LISTEN "{CHANNEL}"')
        watcher, other = WakeUp(first, DEFAULT_SPEC), WakeUp(second, DEFAULT_SPEC)
        assert watcher.idle(1.0)  # took the lock; its own NOTIFY ends the wait at once
        assert other.idle(1.0)  # not watching, but told to look again
        assert not other.watching
        assert not other.idle(0.3)  # nothing new: it sleeps in the watcher's care
        watcher.busy()  # the watcher got work and lets go ...
        woken = [n.payload for n in second.notifies(timeout=1.0, stop_after=1)]
        assert woken == ["relay"]  # ... so the other is woken ...
        other.idle(0.1)
        assert other.watching and not other.asleep  # ... and takes the watch, awake while
        watcher.away()  # the first relay works (holds the wake lock shared); it stops ...
        other.idle(0.1)
        assert other.watching and other.asleep  # ... and now the other sleeps


def test_a_relay_that_gets_work_while_the_watcher_sleeps_stops_writers_notifying(
    engine: sa.Engine,
) -> None:
    """The busy relay is refused the shared hold while the watcher sleeps: it tells the
    watcher, which lets the wake lock go; from the busy relay's next turn on, writers commit
    without notifying, and the watcher looks again at short pauses instead of sleeping."""
    with (
        psycopg.connect(conninfo(engine), autocommit=True) as first,
        psycopg.connect(conninfo(engine), autocommit=True) as second,
        psycopg.connect(conninfo(engine), autocommit=True) as listener,
    ):
        for conn in (first, second, listener):
            conn.execute(f'LISTEN "{CHANNEL}"')
        watcher = fall_asleep(first)
        worker = WakeUp(second, DEFAULT_SPEC)
        worker.busy()
        assert not worker.working  # the watcher sleeps: refused, and told so
        assert watcher.idle(5.0)  # woken by the notice ...
        assert watcher.watching and not watcher.asleep  # ... it lets the wake lock go
        worker.busy()
        assert worker.working
        for _ in listener.notifies(timeout=0.2):
            pass
        with Outbox(engine).transaction() as tx:
            tx.publish("orders", b"1")
        assert writer_notifies(listener, 0.5) == []
        started = time.monotonic()
        assert not watcher.idle(5.0)  # no sleep while a relay works: a short pause
        assert not watcher.idle(5.0) and not watcher.asleep
        assert time.monotonic() - started < 1.0
        worker.idle(0.01)  # the worker is done: the watcher may sleep again
        assert not worker.working
        deadline = time.monotonic() + 2.0
        while not watcher.asleep and time.monotonic() < deadline:
            watcher.idle(0.05)
        assert watcher.asleep


@pytest.mark.serial
def test_while_the_watcher_cannot_sleep_the_other_relays_do_not_either(engine: sa.Engine) -> None:
    """Writers always mid-transaction keep the watcher from the wake lock, and they do not
    notify: the other idle relays must then look again as often as the watcher does, not
    wait for their poll interval."""
    with (
        psycopg.connect(conninfo(engine), autocommit=True) as first,
        psycopg.connect(conninfo(engine), autocommit=True) as second,
    ):
        for conn in (first, second):
            conn.execute(f'LISTEN "{CHANNEL}"')
        watcher, other = WakeUp(first, DEFAULT_SPEC), WakeUp(second, DEFAULT_SPEC)
        ob = Outbox(engine)
        with ob.transaction() as tx:
            tx.publish("orders", b"open")  # holds the wake lock shared until commit
            watcher.idle(0.01)
            assert watcher.watching and not watcher.asleep
            started = time.monotonic()
            assert not other.idle(5.0)
            assert time.monotonic() - started < 0.5  # a settle pause, not the 5 s sleep
            assert not other.watching
        assert watcher.idle(5.0) and watcher.asleep  # committed: the watcher falls asleep
        started = time.monotonic()
        assert other.idle(5.0)  # told to look once more by the watcher's NOTIFY ...
        assert not other.idle(0.3)  # ... then it sleeps, the watcher asleep for it
        assert time.monotonic() - started >= 0.3


WritePath = Callable[[sa.Engine, str], None]


def through_transaction(engine: sa.Engine, url: str) -> None:
    with Outbox(engine).transaction() as tx:
        tx.publish("orders", b"tx")


def through_joined_session(engine: sa.Engine, url: str) -> None:
    with Session(engine) as session, session.begin():
        outbox.publish(session, "orders", b"session")


def through_joined_connection(engine: sa.Engine, url: str) -> None:
    with engine.begin() as conn:
        Outbox(engine).publish(conn, "orders", b"connection")


def through_publish_many(engine: sa.Engine, url: str) -> None:
    with engine.begin() as conn:
        Outbox(engine).publish_many(conn, [Message("orders", b"m1"), Message("orders", b"m2")])


def through_idempotency_key(engine: sa.Engine, url: str) -> None:
    with engine.begin() as conn:
        Outbox(engine).publish(conn, "orders", b"once", idempotency_key=f"k-{time.time_ns()}")


def through_async_api(engine: sa.Engine, url: str) -> None:
    async def write() -> None:
        async_engine = create_async_engine(url)
        try:
            async with AsyncSession(async_engine) as session, session.begin():
                await outbox.apublish(session, "orders", b"async")
        finally:
            await async_engine.dispose()

    asyncio.run(write())


def through_copy(engine: sa.Engine, url: str) -> None:
    with (
        psycopg.connect(conninfo(engine)) as conn,
        conn.cursor() as cur,
        cur.copy("COPY outbox (id, shard, topic, value) FROM STDIN") as copy,
    ):
        copy.write_row(("0190f3a0-0000-7000-8000-000000000001", 0, "orders", b"copy"))


@pytest.mark.parametrize(
    "write",
    [
        through_transaction,
        through_joined_session,
        through_joined_connection,
        through_publish_many,
        through_idempotency_key,
        through_async_api,
        through_copy,
    ],
    ids=lambda f: f.__name__.removeprefix("through_"),
)
def test_every_write_path_wakes_a_sleeping_relay(
    engine: sa.Engine, outbox_url: str, relay_conn: psycopg.Connection, write: WritePath
) -> None:
    fall_asleep(relay_conn)
    write(engine, outbox_url)
    assert writer_notifies(relay_conn, 5) == [CHANNEL]


@pytest.mark.serial
def test_no_commit_is_missed_while_relays_fall_asleep_and_wake(engine: sa.Engine) -> None:
    """Writers commit in bursts while two relays go through the idle/busy cycle as fast as
    they can; after each commit some relay must learn of it without waiting for a poll."""
    stop = threading.Event()
    relays_stop = threading.Event()
    committed: list[float] = []
    seen: list[tuple[float, int]] = []
    lock = threading.Lock()

    def write(number: int) -> None:
        ob = Outbox(engine)
        while not stop.is_set():
            for _ in range(3 + number):
                if stop.is_set():
                    return
                with ob.transaction() as tx:
                    tx.publish("orders", b"x")
                with lock:
                    committed.append(time.monotonic())
            # Quiet spells let the relays fall asleep between bursts; a commit missed just
            # before one would wait until the next burst.
            stop.wait(0.4 + 0.3 * number)

    def relay() -> None:
        with psycopg.connect(conninfo(engine), autocommit=True) as conn:
            conn.execute(f'LISTEN "{CHANNEL}"')
            wake = WakeUp(conn, DEFAULT_SPEC)
            last = 0
            while True:
                # The relay's look: take whatever committed since the last one (and a last
                # look once the writers are done, so that a commit just before it counts).
                finished = relays_stop.is_set()
                count = conn.execute("SELECT count(*) FROM outbox").fetchone()
                total = int(count[0]) if count else 0
                found = total > last
                if found:
                    with lock:
                        seen.append((time.monotonic(), total))
                    last = total
                if finished:
                    return
                if found:
                    wake.busy()
                else:
                    wake.idle(30.0)  # a lost wake-up would show as a 30 s stall

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    threads += [threading.Thread(target=relay) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(8)
    stop.set()
    for thread in threads[:4]:
        thread.join(40)
    relays_stop.set()
    with engine.begin() as conn:  # the relays' last wait ends with this
        conn.execute(sa.text("SELECT pg_notify(:c, 'relay')"), {"c": CHANNEL})
    for thread in threads[4:]:
        thread.join(40)
    assert len(committed) > 60
    # The n-th commit (in time order) is seen by the first look that counts n rows or more.
    worst = 0.0
    for number, at in enumerate(committed, start=1):
        first_look = next((t for t, total in seen if total >= number), None)
        assert first_look is not None, f"commit {number} was never seen"
        worst = max(worst, first_look - at)
    assert worst < 0.3, f"a commit waited {worst:.2f}s: a wake-up was lost"
