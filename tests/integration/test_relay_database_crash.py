"""A PostgreSQL restart or crash under a running relay sends nothing twice that it need not:
marks are durable commits (exactly-once recovery restores only a shard's last batch), and a
mark never runs on a connection the restart killed."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import time
import uuid

import psycopg
import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.devstack.postgres import PostgresServer, _processes_in
from outbox.devstack.procs import pid_alive, wait_until
from outbox.devstack.topics import consume_messages
from outbox.relay.config import EXACTLY_ONCE
from tests.relay_helpers import message_id, relay_config, running_relay, statuses, wait_for

pytestmark = pytest.mark.integration


def publish_one_key(engine: sa.Engine, topic: str, count: int, start: int = 0) -> list[uuid.UUID]:
    """``count`` messages of one key (so one shard), in ONE transaction."""
    with Outbox(engine).transaction() as tx:
        results = tx.publish_many(
            [Message(topic, {"n": n}, key="one-key") for n in range(start, start + count)]
        )
    return [r.message_id for r in results]


def duplicates(bootstrap: str, topic: str, expect: int) -> tuple[int, int]:
    got = consume_messages(bootstrap, topic, expect=expect, timeout=60, quiet=3)
    counts = collections.Counter(message_id(m) for m in got)
    return len(got), sum(c - 1 for c in counts.values())


def aux_pids(server: PostgresServer) -> list[int]:
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE backend_type IN "
            "('walwriter', 'background writer', 'checkpointer')"
        ).fetchall()
    return [int(r[0]) for r in rows]


def crash(server: PostgresServer) -> None:
    """kill -9 every process of the cluster (postmaster first): a power cut for what is still
    only in PostgreSQL's WAL buffers."""
    pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    for child in _processes_in(server.data_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    # A killed process lives on until the kernel has run its exit; a start before that would
    # find the postmaster "running" and do nothing.
    wait_until(lambda: not pid_alive(pid), 30, "the killed postmaster to exit")


def test_a_database_restart_sends_no_acknowledged_batch_again(
    postgres_server: PostgresServer,
    outbox_url: str,
    engine: sa.Engine,
    bootstrap_servers: str,
    make_topic,  # type: ignore[no-untyped-def]
) -> None:
    """A fast restart of PostgreSQL between batches: the pooled connection for marks is
    stale, and its first use comes after Kafka acknowledged the next batch."""
    topic = make_topic("db-restart")
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        publish_one_key(engine, topic, 50)
        wait_for(lambda: statuses(engine).get("sent") == 50, 30, "the first rows sent")
        postgres_server.stop("fast")
        postgres_server.start()
        engine.dispose()
        time.sleep(3)  # the relay reconnects its LISTEN connection and takes its shards back
        publish_one_key(engine, topic, 50, start=50)
        wait_for(lambda: statuses(engine).get("sent") == 100, 60, "the second rows sent")
    total, dups = duplicates(bootstrap_servers, topic, 100)
    assert total - dups == 100
    assert dups == 0, f"{dups} duplicates after a clean PostgreSQL restart"


def test_exactly_once_sends_nothing_twice_after_a_database_crash(
    postgres_server: PostgresServer,
    outbox_url: str,
    engine: sa.Engine,
    bootstrap_servers: str,
    make_topic,  # type: ignore[no-untyped-def]
) -> None:
    """Four exactly-once batches of one shard, marked sent, then a crash. Had a mark been an
    asynchronous commit, the crash would forget it; the take-over recovers only the newest
    progress record, and the earlier batches would be published a second time."""
    topic = make_topic("db-crash-eos")
    prefix = f"db-crash-{uuid.uuid4().hex[:8]}"
    config = relay_config(
        outbox_url,
        bootstrap_servers,
        mode=EXACTLY_ONCE,
        batch_size=50,
        transactional_id_prefix=prefix,
        progress_topic=f"progress-{prefix}",
    )
    publish_one_key(engine, topic, 200)  # synchronous commit: durable
    with psycopg.connect(postgres_server.conninfo(), autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    # Keep the WAL buffers in memory (as a crash within wal_writer_delay would find them).
    stopped = aux_pids(postgres_server)
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        with running_relay(config) as relay:
            wait_for(lambda: statuses(engine).get("sent") == 200, 90, "all rows marked sent")
            assert relay.batches >= 4  # several batches of the one shard were marked
            crash(postgres_server)
            postgres_server.start()
            engine.dispose()
            wait_for(lambda: statuses(engine).get("sent") == 200, 120, "all rows sent again")
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    total, dups = duplicates(bootstrap_servers, topic, 200)
    assert total - dups == 200
    assert dups == 0, f"exactly-once: {dups} duplicates after a PostgreSQL crash"


def test_a_crash_forgets_no_dead_mark_so_no_message_goes_after_a_later_one_of_its_key(
    postgres_server: PostgresServer, outbox_url: str, engine: sa.Engine
) -> None:
    """At-least-once marks of sent rows do not wait for the disk; failures do. m1 and m2 share
    a key; m1 dies (dead rows do not hold their key back) and m2 is sent. Had the dead mark
    been forgotten in a crash, m1 would be pending again and, Kafka well again, go after m2.
    Sent marks that a crash forgets only send their rows again."""
    from tests.relay_helpers import looping
    from tests.stub_sender import StubSender, publish, stub_config, stub_relay

    stub = StubSender(latency=0.01)
    first: list[uuid.UUID] = []
    kafka_refuses_m1 = True
    stub.decide = lambda record: (
        "dead" if kafka_refuses_m1 and first and record.id == first[0] else "ack"
    )
    stopped = aux_pids(postgres_server)  # WAL not flushed by a commit stays in memory
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        with looping(stub_relay(stub_config(outbox_url), stub)):
            first.extend(publish(engine, 2, keys=1))  # m1, m2: one key, one transaction
            wait_for(lambda: statuses(engine) == {"sent": 1, "dead": 1}, 30, "m1 dead, m2 sent")
            others = publish(engine, 20, keys=20)  # marked sent without waiting for the disk
            wait_for(lambda: statuses(engine).get("sent") == 21, 30, "the others sent")
            kafka_refuses_m1 = False
            crash(postgres_server)
            postgres_server.start()
            engine.dispose()
            wait_for(lambda: "pending" not in statuses(engine), 60, "nothing pending")
            assert statuses(engine) == {"sent": 21, "dead": 1}
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    delivered = [record.id for record in stub.acked]
    assert first[0] not in delivered, "the dead message was sent after a later one of its key"
    assert set(others) <= set(delivered)


def test_a_relay_started_while_the_database_is_down_waits_for_it(
    postgres_server: PostgresServer,
    outbox_url: str,
    engine: sa.Engine,
    bootstrap_servers: str,
    make_topic,  # type: ignore[no-untyped-def]
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """A supervisor may restart a relay while PostgreSQL restarts too: the relay waits (up to
    --start-timeout) instead of exiting, then serves; a SIGTERM meanwhile exits 0."""
    from tests.relay_helpers import start_relay_process, stop_process

    topic = make_topic("late-db")
    publish_one_key(engine, topic, 5)
    engine.dispose()
    log = tmp_path / "relay.log"
    postgres_server.stop("fast")
    try:
        relay = start_relay_process(outbox_url, bootstrap_servers, log=log, ready=False)
        stopped_early = start_relay_process(outbox_url, bootstrap_servers, ready=False)
        time.sleep(4)
        assert relay.poll() is None and stopped_early.poll() is None, log.read_text()
        assert stop_process(stopped_early) == 0  # stopped while it waited: nothing to undo
    finally:
        postgres_server.start()
    try:
        wait_for(lambda: statuses(engine).get("sent") == 5, 60, "the rows sent")
    finally:
        assert stop_process(relay) == 0
    assert "database not ready" in log.read_text()
