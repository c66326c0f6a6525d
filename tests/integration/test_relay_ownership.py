"""Shard ownership after a relay gives a shard up: the advisory lock goes with it, so the shard
is never left locked by a relay that no longer sends it."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
import uuid

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from outbox import Message, Outbox
from outbox.relay.daemon import Relay
from outbox.relay.producers import ExactlyOncePublisher
from outbox.relay.progress import ensure_progress_topic
from outbox.schema import SHARD_COUNT, shard_of
from tests.relay_helpers import relay_config, running_relay, wait_for

pytestmark = pytest.mark.integration

LAST_SHARD = SHARD_COUNT - 1  # the first a relay lets go of when another joins


def key_of_shard(shard: int) -> str:
    n = 0
    while shard_of(f"key-{n}".encode(), uuid.uuid4()) != shard:
        n += 1
    return f"key-{n}"


def owned(relay: Relay) -> set[int]:
    return set(relay._ownership.owned) if relay._ownership is not None else set()


def unsent(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(sa.text("SELECT count(*) FROM outbox WHERE status <> 'sent'")).scalar_one()
        )


def test_a_shard_given_up_after_its_producer_was_fenced_is_unlocked(
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
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
        intruder = ExactlyOncePublisher(
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
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
    from outbox.devstack.procs import free_port

    topic = make_topic("unreachable")
    healthy = relay_config(outbox_url, bootstrap_servers, metrics_port=0)
    cut_off = relay_config(outbox_url, f"127.0.0.1:{free_port()}", metrics_port=0)
    with running_relay(healthy) as first:
        wait_for(lambda: len(owned(first)) == SHARD_COUNT, 60, "the healthy relay to own all")
        with running_relay(cut_off) as second:
            wait_for(lambda: second.health.database_ok, 30, "the second relay connected")
            for _ in range(3):  # a few rebalance rounds of both
                time.sleep(1.0)
                assert len(owned(first)) == SHARD_COUNT and not owned(second)
            ready = urllib.request.Request(f"http://127.0.0.1:{second.metrics_server_port}/readyz")
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(ready, timeout=5)
            assert answer.value.code == 503
            assert b"Kafka out of reach" in answer.value.read()
            with Outbox(engine).transaction() as tx:
                tx.publish_many([Message(topic, {"n": n}, key=f"k{n}") for n in range(50)])
            wait_for(lambda: unsent(engine) == 0, 30, "every message sent by the healthy relay")


def test_a_shard_let_go_with_a_hold_off_is_not_locked_again_until_it_ends(
    outbox_url: str,
) -> None:
    import psycopg

    from outbox.relay.ownership import ShardOwnership
    from outbox.schema import DEFAULT_SPEC

    url = sa.make_url(outbox_url).set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as conn:
        ownership = ShardOwnership(conn, DEFAULT_SPEC, member_number=1)
        ownership.join()
        assert len(ownership.rebalance()[0]) == SHARD_COUNT
        ownership.release([3], hold_off=1.0)
        assert 3 not in ownership.owned
        assert ownership.rebalance() == ([], [])  # free, but held off
        time.sleep(1.1)
        assert ownership.rebalance() == ([3], [])


def test_a_rebalance_locks_exactly_the_shards_it_reports_and_no_more(outbox_url: str) -> None:
    """The share's free shards are tried in one pipelined round trip; a shard another
    relay holds is left alone, and no lock is taken beyond the share."""
    import psycopg

    from outbox.relay.ownership import ShardOwnership
    from outbox.schema import DEFAULT_SPEC

    url = sa.make_url(outbox_url).set(drivername="postgresql").render_as_string(False)
    with (
        psycopg.connect(url, autocommit=True) as first_conn,
        psycopg.connect(url, autocommit=True) as second_conn,
    ):
        first = ShardOwnership(first_conn, DEFAULT_SPEC, member_number=5)
        first.join()
        assert len(first.rebalance()[0]) == SHARD_COUNT  # alone: every shard
        second = ShardOwnership(second_conn, DEFAULT_SPEC, member_number=9)
        second.join()
        # Two members now: the first lets go of the shards above its half...
        gained, let_go = first.rebalance()
        assert gained == [] and len(let_go) == SHARD_COUNT // 2
        # ...and the second takes exactly those, without touching the first's.
        assert second.rebalance() == (let_go, [])
        for ownership, conn in ((first, first_conn), (second, second_conn)):
            held = {
                int(row[0])
                for row in conn.execute(
                    "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                    " AND objsubid = 2 AND classid = %s::bigint::oid AND pid = pg_backend_pid()",
                    (DEFAULT_SPEC.lock_space("shard"),),
                )
            }
            assert held == ownership.owned
        assert first.owned.isdisjoint(second.owned) and second.owned == set(let_go)
        assert second.rebalance() == ([], [])  # its share is full: it tries nothing more
