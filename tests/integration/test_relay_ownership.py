"""Shard ownership after a relay gives a shard up: the advisory lock goes with it, so the shard
is never left locked by a relay that no longer sends it; and the leases' rebalance locks
exactly the shards it reports."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable

import psycopg
import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from outbox import Message, Outbox
from outbox.relay.commands import Rebalance, Rebalanced
from outbox.relay.daemon import Relay
from outbox.relay.leases import Leases
from outbox.relay.progress import ensure_progress_topic
from outbox.relay.transactions import ExactlyOnceSender
from outbox.schema import DEFAULT_SPEC, SHARD_COUNT, shard_of
from tests.relay_helpers import relay_config, running_relay, wait_for

pytestmark = pytest.mark.integration

LAST_SHARD = SHARD_COUNT - 1  # the first a relay lets go of when another joins


def key_of_shard(shard: int) -> str:
    n = 0
    while shard_of(f"key-{n}".encode(), uuid.uuid4()) != shard:
        n += 1
    return f"key-{n}"


def owned(relay: Relay) -> set[int]:
    return set(relay.owned_shards)


def unsent(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(sa.text("SELECT count(*) FROM outbox WHERE status <> 'sent'")).scalar_one()
        )


def readyz(relay: Relay) -> tuple[int, str]:
    """The status and body of the relay's /readyz (0: not served yet)."""
    if relay.metrics_server_port is None:
        return 0, ""
    url = f"http://127.0.0.1:{relay.metrics_server_port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def holds_for(check: Callable[[], bool], seconds: float, what: str) -> None:
    """``check()`` stays true, looked at every 0.2 s, for ``seconds``."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert check(), what
        time.sleep(0.2)


def test_a_shard_given_up_after_its_producer_was_fenced_is_unlocked(
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic: Callable[..., str]
) -> None:
    topic = make_topic("orphan")
    prefix = f"orphan-{uuid.uuid4().hex[:8]}"
    progress = f"p-{prefix}"
    ensure_progress_topic(AdminClient({"bootstrap.servers": bootstrap_servers}), progress)
    config = relay_config(
        outbox_url,
        bootstrap_servers,
        mode="exactly-once",
        transactional_id_prefix=prefix,
        progress_topic=progress,
    )
    key = key_of_shard(LAST_SHARD)
    ob = Outbox(engine)

    def publish(count: int) -> None:
        with ob.transaction() as tx:
            tx.publish_many([Message(topic, {"n": n}, key=key) for n in range(count)])

    with running_relay(config) as first:
        wait_for(lambda: len(owned(first)) == SHARD_COUNT, 60, "the first relay to own every shard")
        publish(10)
        wait_for(lambda: unsent(engine) == 0, 30, "the first messages sent")
        # Something else opens the shard's transactional id: the relay's producer is fenced.
        intruder = ExactlyOnceSender(
            {"bootstrap.servers": bootstrap_servers},
            transactional_id_prefix=prefix,
            progress_topic=progress,
            owner="intruder",
            delivery_timeout_ms=10_000,
        )
        intruder.take_over([LAST_SHARD])
        intruder.close()
        publish(10)
        # The relay gives the shard up, takes it again (fencing the intruder) and sends.
        wait_for(lambda: unsent(engine) == 0, 60, "the shard sent again after the fence")
        with running_relay(config) as second:
            wait_for(
                lambda: (
                    len(owned(first)) + len(owned(second)) == SHARD_COUNT
                    and len(owned(second)) == SHARD_COUNT // 2
                ),
                60,
                "the two relays to share every shard",
            )
            assert LAST_SHARD in owned(second)
            publish(10)
            wait_for(lambda: unsent(engine) == 0, 60, "the shard sent by its new owner")


def test_a_relay_that_cannot_reach_kafka_takes_no_shards_and_is_not_ready(
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic: Callable[..., str]
) -> None:
    from outbox.devstack.procs import free_port

    topic = make_topic("unreachable")
    healthy = relay_config(outbox_url, bootstrap_servers, metrics_port=0)
    cut_off = relay_config(outbox_url, f"127.0.0.1:{free_port()}", metrics_port=0)
    with running_relay(healthy) as first:
        wait_for(lambda: len(owned(first)) == SHARD_COUNT, 60, "the healthy relay to own all")
        with running_relay(cut_off) as second:
            wait_for(
                lambda: readyz(second)[0] == 503 and "database" not in readyz(second)[1],
                30,
                "the second relay connected to the database",
            )
            holds_for(  # a good many rebalance rounds of both (every 0.2 s)
                lambda: len(owned(first)) == SHARD_COUNT and not owned(second),
                3.0,
                "the cut-off relay took shards from the healthy one",
            )
            status, body = readyz(second)
            assert status == 503 and "Kafka out of reach" in body, body
            with Outbox(engine).transaction() as tx:
                tx.publish_many([Message(topic, {"n": n}, key=f"k{n}") for n in range(50)])
            wait_for(lambda: unsent(engine) == 0, 30, "every message sent by the healthy relay")
            assert not owned(second)


def owner_session(outbox_url: str) -> Callable[[], psycopg.Connection]:
    url = sa.make_url(outbox_url).set(drivername="postgresql")
    conninfo = url.render_as_string(hide_password=False)
    return lambda: psycopg.connect(conninfo, autocommit=True)


def rebalance(leases: Leases, *, join: bool = False, may_gain: bool = True) -> Rebalanced:
    """A rebalance as the relay's core asks it of an idle relay: any owned shard may go."""
    return leases.rebalance(Rebalance(tuple(sorted(leases.owned)), may_gain=may_gain, join=join))


def test_a_shard_let_go_with_a_hold_off_is_not_locked_again_until_it_ends(
    outbox_url: str,
) -> None:
    leases = Leases(DEFAULT_SPEC, owner_session(outbox_url))
    leases.member_number = 1
    leases.connect()
    try:
        assert len(rebalance(leases, join=True).gained) == SHARD_COUNT
        released = time.monotonic()
        leases.release([3], hold_off=1.0)
        assert 3 not in leases.owned
        tries = 0
        while not (gained := rebalance(leases)).gained:  # free, but held off
            assert gained.lost == ()
            tries += 1
            assert time.monotonic() - released < 5, "the held-off shard was never taken again"
            time.sleep(0.05)
        assert gained.gained == (3,) and gained.lost == ()
        assert time.monotonic() - released >= 1.0, "locked again before its hold-off ended"
        assert tries > 0
    finally:
        leases.forget()


def test_a_rebalance_locks_exactly_the_shards_it_reports_and_no_more(outbox_url: str) -> None:
    """The share's free shards are tried in one pipelined round trip; a shard another
    relay holds is left alone, and no lock is taken beyond the share."""
    first = Leases(DEFAULT_SPEC, owner_session(outbox_url))
    second = Leases(DEFAULT_SPEC, owner_session(outbox_url))
    first.member_number, second.member_number = 5, 9
    first.connect()
    second.connect()
    try:
        assert len(rebalance(first, join=True).gained) == SHARD_COUNT  # alone: every shard
        joined = rebalance(second, join=True, may_gain=False)
        assert joined.joined and joined.gained == () and joined.other_members == 1
        # Two members now: the first lets go of the shards above its half...
        let_go = rebalance(first)
        assert let_go.gained == () and len(let_go.lost) == SHARD_COUNT // 2
        # ...and the second takes exactly those, without touching the first's.
        taken = rebalance(second)
        assert (taken.gained, taken.lost) == (tuple(sorted(let_go.lost)), ())
        for leases in (first, second):
            assert leases.conn is not None
            held = {
                int(row[0])
                for row in leases.conn.execute(
                    "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                    " AND objsubid = 2 AND classid = %s::bigint::oid AND pid = pg_backend_pid()",
                    (DEFAULT_SPEC.lock_space("shard"),),
                )
            }
            assert held == leases.owned
        assert first.owned.isdisjoint(second.owned) and second.owned == set(let_go.lost)
        again = rebalance(second)  # its share is full: it tries nothing more
        assert (again.gained, again.lost) == ((), ())
    finally:
        first.forget()
        second.forget()
