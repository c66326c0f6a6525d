"""Shards changing hands under load: a relay killed with -9, relays joining a running one.

Messages of the shards that move wait for the take-over; the messages of every other shard
must not. Each case writes 100 messages a second over 64 keys, makes shards move, and measures
the worst commit-to-sent delay (``sent_at - created_at``) of the messages committed after.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.schema import SHARD_COUNT, OutboxTableSpec
from tests.relay_helpers import RelayProcess, start_relay_process, stop_process, wait_for

# The worst delays are wall-clock bounds: run alone, after the parallel tests.
pytestmark = [pytest.mark.integration, pytest.mark.serial]

#: Worst commit-to-sent delay allowed after shards moved. Taking shards over one after
#: another inside the loop delayed messages by 8-13 s here (exactly-once); in the background,
#: side by side, the moved shards wait for the next rebalance (0.5 s) and their take-over
#: (0.5-1.4 s measured after a kill -9), the others for nothing. Measured on a busy machine:
#: at most 2.2 s exactly-once, 0.5 s at-least-once. The bound leaves room for a busier
#: machine and stays far below the old figure.
WORST_DELAY_SECONDS = 4.0

LOG = Path("/tmp/rt_relays.log")
RATE = 100
KEYS = 64


def shard_shares(engine: sa.Engine) -> list[int]:
    """How many shards each session holds in this database, largest first."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND objsubid = 2 AND classid = CAST(CAST(:space AS bigint) AS oid)"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " GROUP BY pid ORDER BY 1 DESC"
            ),
            {"space": OutboxTableSpec().lock_space("shard")},
        ).fetchall()
    return [int(row[0]) for row in rows]


@contextmanager
def writing(engine: sa.Engine, topic: str) -> Iterator[None]:
    """RATE messages a second, one a transaction, over KEYS keys, for the block's length."""
    stop = threading.Event()

    def write() -> None:
        ob = Outbox(engine)
        n = 0
        next_at = time.monotonic()
        while not stop.is_set():
            with ob.transaction() as tx:
                tx.publish(topic, {"n": n}, key=f"key-{n % KEYS}")
            n += 1
            next_at += 1 / RATE
            stop.wait(max(0.0, next_at - time.monotonic()))

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def database_now(engine: sa.Engine) -> object:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()


def worst_by_shard(engine: sa.Engine, since: object) -> dict[int, float]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT shard, max(extract(epoch FROM sent_at - created_at)) FROM outbox"
                " WHERE created_at >= :since GROUP BY shard ORDER BY shard"
            ),
            {"since": since},
        )
        return {int(shard): round(float(worst), 2) for shard, worst in rows}


def worst_delay_since(engine: sa.Engine, since: object) -> tuple[float, int]:
    """The worst commit-to-sent delay of the messages committed after ``since``, and their
    count."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT max(extract(epoch FROM sent_at - created_at)), count(*)"
                " FROM outbox WHERE created_at >= :since"
            ),
            {"since": since},
        ).one()
    return float(row[0]), int(row[1])


def all_sent(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        return not conn.execute(
            sa.text("SELECT count(*) FROM outbox WHERE status <> 'sent'")
        ).scalar_one()


def settled(engine: sa.Engine) -> bool:
    """Every take-over done: no message has waited for a second."""
    with engine.connect() as conn:
        return not conn.execute(
            sa.text(
                "SELECT count(*) FROM outbox WHERE status = 'pending'"
                " AND created_at < clock_timestamp() - interval '1 second'"
            )
        ).scalar_one()


def relay_args(mode: str) -> list[str]:
    prefix = f"takeover-{uuid.uuid4().hex[:8]}"
    args = ["--mode", mode]
    if mode == "exactly-once":
        args += ["--transactional-id-prefix", prefix, "--progress-topic", f"p-{prefix}"]
    return args


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_a_relay_killed_with_9_delays_no_message_for_long(
    engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    make_topic,
    mode: str,
    tmp_path: Path,
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("killed", partitions=4)
    log = tmp_path / "relays.log"
    args = relay_args(mode)
    relays: list[RelayProcess] = []
    try:
        with writing(engine, topic):
            relays.append(start_relay_process(outbox_url, bootstrap_servers, *args, log=log))
            relays.append(start_relay_process(outbox_url, bootstrap_servers, *args, log=log))
            half = SHARD_COUNT // 2
            wait_for(lambda: shard_shares(engine) == [half, half], 60, "two relays, 8 shards each")
            wait_for(lambda: settled(engine), 60, "every take-over done")
            time.sleep(2)  # steady state
            since = database_now(engine)
            relays[0].send_signal(signal.SIGKILL)
            relays[0].wait(10)
            wait_for(lambda: shard_shares(engine) == [SHARD_COUNT], 30, "the survivor owns all")
            time.sleep(5)
        wait_for(lambda: all_sent(engine), 60, "every message sent")
        worst, count = worst_delay_since(engine, since)
    finally:
        for relay in relays:
            stop_process(relay, signal.SIGKILL)
    print(f"{mode}: worst commit-to-sent delay after kill -9: {worst:.3f}s over {count} messages")
    print(worst_by_shard(engine, since))
    assert count >= RATE * 5
    assert worst < WORST_DELAY_SECONDS


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_two_relays_joining_a_busy_one_delay_no_message_for_long(
    engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    make_topic,
    mode: str,
    tmp_path: Path,
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("joining", partitions=4)
    log = tmp_path / "relays.log"
    args = relay_args(mode)
    relays: list[RelayProcess] = []
    try:
        with writing(engine, topic):
            relays.append(start_relay_process(outbox_url, bootstrap_servers, *args, log=log))
            wait_for(lambda: shard_shares(engine) == [SHARD_COUNT], 60, "one relay owns all")
            wait_for(lambda: settled(engine), 60, "every take-over done")
            time.sleep(2)  # steady state
            since = database_now(engine)
            relays += [
                start_relay_process(outbox_url, bootstrap_servers, *args, ready=False, log=log)
                for _ in range(2)
            ]
            wait_for(
                lambda: len(shard_shares(engine)) == 3 and sum(shard_shares(engine)) == SHARD_COUNT,
                60,
                "three relays share the shards",
            )
            time.sleep(5)
        wait_for(lambda: all_sent(engine), 60, "every message sent")
        worst, count = worst_delay_since(engine, since)
    finally:
        for relay in relays:
            stop_process(relay, signal.SIGKILL)
    print(f"{mode}: worst commit-to-sent delay, two relays joining: {worst:.3f}s over {count}")
    print(worst_by_shard(engine, since))
    assert count >= RATE * 5
    assert worst < WORST_DELAY_SECONDS
