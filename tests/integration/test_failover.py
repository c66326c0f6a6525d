"""A PostgreSQL failover under every part that talks to the database: the local stack's
standby promoted (the primary killed with -9), and each part connecting again through the
URL that lists both servers, on the new primary.

The stack is one primary and a streaming standby of its own (not the session's PostgreSQL);
each test that promotes builds a new standby afterwards, on the old primary's port, so the
URL stays the same for every test of the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import Outbox, migrate
from outbox.chaos.proxy import FaultProxy
from outbox.devstack.postgres import PostgresServer
from outbox.devstack.procs import StackError, free_port
from outbox.devstack.replication import ASYNCHRONOUS, SYNCHRONOUS, in_recovery, wait_caught_up
from outbox.devstack.stack import LocalStack, stack_home
from outbox.devstack.topics import consume_messages
from outbox.engines import database_url as driver_url
from outbox.immediate import ImmediateSender
from outbox.prepared import (
    COMMIT,
    CheckbackConfig,
    CheckbackRunner,
    CheckRegistry,
    PreparedMessages,
)
from outbox.relay.config import AT_LEAST_ONCE, EXACTLY_ONCE, RelayConfig
from tests.inbox_app import make_inbox
from tests.inbox_helpers import (
    consumer_config,
    ledger_count,
    prepare_database,
    produce,
    running_consumer,
)
from tests.relay_helpers import (
    message_id,
    publish_orders,
    relay_config,
    running_in_thread,
    running_relay,
    start_relay_process,
    statuses,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

#: The longest a relay may take from the primary's kill to its first message sent from the
#: new primary.
RELAY_RESUMES_WITHIN = 15.0


@pytest.fixture(scope="module")
def replicated() -> Iterator[LocalStack]:
    """A primary and an asynchronous standby (tests switch the replication as they need)."""
    stack = LocalStack(
        stack_home() / "run" / f"pytest-{os.getpid()}-failover", durable=False, standby=ASYNCHRONOUS
    )
    try:
        stack.up_postgres()
        stack.up_standby()
    except StackError as exc:
        pytest.fail(f"PostgreSQL with a standby did not start: {exc}")
    yield stack
    stack.down()


@pytest.fixture
def standing(replicated: LocalStack) -> Iterator[LocalStack]:
    """The stack with its standby running (built again after a test promoted it), and
    asynchronous replication unless the test sets another."""
    replicated.replication = ASYNCHRONOUS
    replicated.up_standby()
    yield replicated
    replicated.replication = ASYNCHRONOUS
    replicated.up_standby()


@pytest.fixture
def failover_url(standing: LocalStack) -> Iterator[str]:
    """A fresh database with the outbox table, reached through the URL that lists both
    servers (SQLAlchemy's form)."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    standing.postgres.create_database(name)
    url = standing.database_url(name)
    migrate.upgrade(url)
    yield url
    standing.postgres.drop_database(name)


def fail_over(stack: LocalStack) -> float:
    """Kill the primary (-9) and promote the standby; returns the time of the kill."""
    wait_caught_up(stack.postgres, stack.standby, stack.replication or ASYNCHRONOUS)  # type: ignore[arg-type]
    killed = time.monotonic()
    stack.promote()
    return killed


def server_port(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT inet_server_port()")).scalar_one())


# -- the URL ------------------------------------------------------------------------------


@pytest.mark.parametrize("replication", [SYNCHRONOUS, ASYNCHRONOUS])
def test_the_stacks_url_in_both_forms_follows_the_primary(
    standing: LocalStack, replication: str
) -> None:
    standing.replication = replication
    standing.up_standby()
    info = standing.info("postgres")
    assert info.libpq_database_url is not None
    assert "target_session_attrs=read-write" in info.database_url
    assert "&port=" in info.libpq_database_url  # libpq's host=a,b&port=x,y
    engines = [
        sa.create_engine(info.database_url, pool_pre_ping=True),
        sa.create_engine(driver_url(info.libpq_database_url), pool_pre_ping=True),
    ]
    try:
        with engines[0].connect() as conn:
            names = conn.execute(sa.text("SHOW synchronous_standby_names")).scalar_one()
            state = conn.execute(sa.text("SELECT sync_state FROM pg_stat_replication")).all()
        assert (names, [row[0] for row in state]) == (
            ("*", ["sync"]) if replication == SYNCHRONOUS else ("", ["async"])
        )
        first = standing.postgres.port
        assert {server_port(engine) for engine in engines} == {first}
        assert standing.standby is not None and in_recovery(standing.standby)

        fail_over(standing)
        assert {server_port(engine) for engine in engines} == {standing.postgres.port} != {first}
        # The promoted server waits for no standby (it has none): commits go through.
        with engines[1].begin() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS after_promotion (n int)"))
            conn.execute(sa.text("INSERT INTO after_promotion VALUES (1)"))

        standing.up_standby()  # a new standby, on the old primary's port
        assert standing.info("postgres") == info  # the same URL, in both forms
        assert standing.standby is not None and standing.standby.port == first
        with engines[0].begin() as conn:
            conn.execute(sa.text("DROP TABLE after_promotion"))
    finally:
        for engine in engines:
            engine.dispose()


def test_a_synchronous_promotion_keeps_every_acknowledged_commit(standing: LocalStack) -> None:
    standing.replication = SYNCHRONOUS
    standing.up_standby()
    engine = sa.create_engine(standing.database_url("postgres"), pool_pre_ping=True)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE acknowledged (n int)"))
        for n in range(200):
            with engine.begin() as conn:
                conn.execute(sa.text("INSERT INTO acknowledged VALUES (:n)"), {"n": n})
        standing.promote()  # at once: no wait for the standby to replay
        with engine.connect() as conn:
            count = conn.execute(sa.text("SELECT count(*) FROM acknowledged")).scalar_one()
        assert count == 200
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE acknowledged"))
    finally:
        engine.dispose()


# -- each part of outbox, through the URL --------------------------------------------------


def test_a_writer_publishes_through_the_url_after_a_promotion(
    standing: LocalStack, failover_url: str, make_topic: Callable[..., str]
) -> None:
    topic = make_topic("writer")
    engine = sa.create_engine(failover_url, pool_pre_ping=True)
    try:
        before = publish_orders(engine, topic, 10)
        fail_over(standing)
        after = publish_orders(engine, topic, 10, start=10)  # the pool's ping replaces the dead
        assert server_port(engine) == standing.postgres.port
        with engine.connect() as conn:
            held = set(conn.execute(sa.text("SELECT id FROM outbox")).scalars())
        assert held == {*before, *after}
    finally:
        engine.dispose()


def test_an_immediate_sender_sends_through_the_url_after_a_promotion(
    standing: LocalStack, failover_url: str, make_topic: Callable[..., str], bootstrap_servers: str
) -> None:
    topic = make_topic("immediate")
    engine = sa.create_engine(failover_url, pool_pre_ping=True)
    sender = ImmediateSender(engine, {"bootstrap.servers": bootstrap_servers})
    outbox = Outbox(engine, immediate=sender)
    try:
        with outbox.transaction() as tx:
            tx.publish(topic, {"n": 0}, key="k")
        wait_for(lambda: statuses(engine) == {"sent": 1}, 30, "the first message sent")
        fail_over(standing)
        with outbox.transaction() as tx:
            tx.publish(topic, {"n": 1}, key="k")
        wait_for(lambda: statuses(engine) == {"sent": 2}, 30, "the message after the promotion")
        assert server_port(engine) == standing.postgres.port
        assert len(consume_messages(bootstrap_servers, topic, expect=2, timeout=30)) == 2
    finally:
        sender.close(10)
        engine.dispose()


def test_an_inbox_consumer_applies_through_the_url_after_a_promotion(
    standing: LocalStack, failover_url: str, make_topic: Callable[..., str], bootstrap_servers: str
) -> None:
    topic = make_topic("inbox")
    engine = prepare_database(failover_url)
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = consumer_config(failover_url, bootstrap_servers)
    try:
        with running_consumer(make_inbox([topic], group), config):
            produce(bootstrap_servers, topic, range(20))
            wait_for(lambda: ledger_count(engine) == 20, 60, "the first records applied")
            fail_over(standing)
            produce(bootstrap_servers, topic, range(20, 40))
            wait_for(lambda: ledger_count(engine) == 40, 60, "the records after the promotion")
        with engine.connect() as conn:
            applied = conn.execute(sa.text("SELECT count(DISTINCT n) FROM ledger")).scalar_one()
        assert applied == 40 and server_port(engine) == standing.postgres.port
    finally:
        engine.dispose()


def test_a_checkback_runner_resolves_through_the_url_after_a_promotion(
    standing: LocalStack, failover_url: str, make_topic: Callable[..., str]
) -> None:
    topic = make_topic("checkback")
    registry = CheckRegistry()
    registry.add_checker(lambda message: COMMIT, "orders")
    prepared = PreparedMessages(Outbox(failover_url), group="orders", check_after=0.2)
    config = CheckbackConfig(database_url=failover_url, poll_interval=0.2, check_interval=0.5)
    engine = sa.create_engine(failover_url, pool_pre_ping=True)
    try:
        with running_in_thread(CheckbackRunner(registry, config), "checkback"):
            prepared.prepare(topic, {"n": 0}, key="k")
            wait_for(lambda: statuses(engine) == {"pending": 1}, 30, "the first check's commit")
            fail_over(standing)
            prepared.prepare(topic, {"n": 1}, key="k")
            wait_for(lambda: statuses(engine) == {"pending": 2}, 60, "the check after promotion")
        assert server_port(engine) == standing.postgres.port
    finally:
        engine.dispose()
        prepared.outbox.engine.dispose()


@pytest.mark.parametrize("form", ["sqlalchemy", "libpq"])
def test_the_cli_and_the_migrations_work_through_the_url_after_a_promotion(
    standing: LocalStack, failover_url: str, make_topic: Callable[..., str], form: str
) -> None:
    engine = sa.create_engine(failover_url, pool_pre_ping=True)
    name = sa.make_url(failover_url).database or "postgres"
    url = failover_url if form == "sqlalchemy" else standing.info(name).libpq_database_url
    assert url is not None
    try:
        publish_orders(engine, make_topic("cli"), 3)
        fail_over(standing)
        migrate.upgrade(url)  # Alembic through the URL: already at head
        status = subprocess.run(
            [sys.executable, "-m", "outbox.cli", "status", "--json", "--database-url", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["statuses"]["pending"]["count"] == 3
    finally:
        engine.dispose()


# -- the relay --------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["sqlalchemy", "libpq"])
def test_a_relay_on_the_multi_host_url_resumes_after_a_promotion(
    standing: LocalStack,
    failover_url: str,
    make_topic: Callable[..., str],
    bootstrap_servers: str,
    tmp_path: Path,
    form: str,
) -> None:
    url = failover_url
    if form == "libpq":
        name = sa.make_url(failover_url).database
        libpq = standing.info(name or "postgres").libpq_database_url
        assert libpq is not None
        url = libpq
    topic = make_topic("relay-url")
    engine = sa.create_engine(failover_url, pool_pre_ping=True)
    relay = start_relay_process(
        url, bootstrap_servers, "--start-timeout", "20", log=tmp_path / "relay.log", ready=False
    )
    try:
        publish_orders(engine, topic, 20)
        wait_for(lambda: statuses(engine) == {"sent": 20}, 15, "the relay to send")
        killed = fail_over(standing)
        publish_orders(engine, topic, 20, start=20)
        wait_for(lambda: statuses(engine) == {"sent": 40}, 60, "the relay after the promotion")
        assert time.monotonic() - killed < RELAY_RESUMES_WITHIN + 5
    finally:
        stop_process(relay)
        engine.dispose()


@pytest.mark.parametrize("mode", [AT_LEAST_ONCE, EXACTLY_ONCE])
def test_a_relay_behind_an_address_that_moves_to_the_new_primary_resumes_within_15s(
    standing: LocalStack,
    failover_url: str,
    make_topic: Callable[..., str],
    bootstrap_servers: str,
    mode: str,
) -> None:
    """The relay's URL names one address (a virtual IP, or a proxy that follows the primary)
    that moves to the promoted standby: its first message from the new primary goes within
    15 s of the kill."""
    topic = make_topic("relay-moves", partitions=3)
    engine = sa.create_engine(failover_url, pool_pre_ping=True)
    address = FaultProxy(free_port(), standing.postgres.port)
    address.start()
    name = sa.make_url(failover_url).database
    relay_url = standing.postgres.url(name or "postgres").replace(
        f":{standing.postgres.port}/", f":{address.listen_port}/"
    )
    prefix = f"fo-{uuid.uuid4().hex[:8]}"
    config = relay_config(
        relay_url,
        bootstrap_servers,
        mode=mode,
        transactional_id_prefix=prefix,
        progress_topic=f"p-{prefix}",
    )
    try:
        with running_relay(config):
            publish_orders(engine, topic, 50)
            wait_for(lambda: statuses(engine) == {"sent": 50}, 60, "the relay to send")
            killed = fail_over(standing)
            address.retarget(standing.postgres.port)
            publish_orders(engine, topic, 1, start=50)
            wait_for(lambda: statuses(engine) == {"sent": 51}, 60, "the relay on the new primary")
            resumed = time.monotonic() - killed
        got = consume_messages(bootstrap_servers, topic, expect=51, timeout=30)
        assert {message_id(m) for m in got} == set(_ids(engine))
        assert resumed <= RELAY_RESUMES_WITHIN, f"{resumed:.1f} s from the kill to a send"
    finally:
        address.close()
        engine.dispose()


def _ids(engine: sa.Engine) -> list[uuid.UUID]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT id FROM outbox")).scalars())


# -- exactly-once recovery after a failover -----------------------------------------------


def sent_offsets(engine: sa.Engine) -> dict[uuid.UUID, tuple[int, int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, kafka_partition, kafka_offset FROM outbox WHERE status = 'sent'")
        )
        return {row[0]: (row[1], row[2]) for row in rows}


def test_exactly_once_recovery_marks_what_the_topics_hold_after_the_standby_missed_the_marks(
    standing: LocalStack,
    failover_url: str,
    make_topic: Callable[..., str],
    bootstrap_servers: str,
) -> None:
    """The rows reached the standby, the marks of their sends did not (it stopped streaming
    first, as an asynchronous standby lags): after the promotion every row is pending again,
    and a relay taking the shards over marks each one sent from its shard's progress records,
    at the offset its record holds, instead of sending it twice (docs/relay.md,
    "Exactly-once mode")."""
    topic = make_topic("eos-failover", partitions=3)
    engine = sa.create_engine(failover_url, pool_pre_ping=True)
    prefix = f"fo-{uuid.uuid4().hex[:8]}"

    def relay_on(server: PostgresServer) -> RelayConfig:
        # The primary's own address, each time (the multi-host URL is tested above).
        return relay_config(
            server.url(sa.make_url(failover_url).database or "postgres"),
            bootstrap_servers,
            mode=EXACTLY_ONCE,
            transactional_id_prefix=prefix,
            progress_topic=f"p-{prefix}",
            batch_size=20,  # several batches per shard, within the 32 that recovery reads back
        )

    standby = standing.standby
    assert standby is not None
    try:
        ids = publish_orders(engine, topic, 300, keys=10)
        wait_caught_up(standing.postgres, standby, ASYNCHRONOUS)
        standby.stop()  # the standby has every row, and will have no mark
        with running_relay(relay_on(standing.postgres)):
            wait_for(lambda: statuses(engine) == {"sent": 300}, 60, "the relay to send")
        sent_before = sent_offsets(engine)

        standing.postgres.kill()  # with the marks
        standby.start()  # it streams no more: its primary is gone
        standing.promote()
        assert statuses(engine) == {"pending": 300}, "the promotion forgot the marks"

        with running_relay(relay_on(standing.postgres)):
            wait_for(lambda: statuses(engine) == {"sent": 300}, 60, "the take-over's recovery")
            assert sent_offsets(engine) == sent_before  # marked from the records: not sent again
            later = publish_orders(engine, topic, 10, keys=10, start=300)
            wait_for(lambda: statuses(engine) == {"sent": 310}, 60, "the messages after it")
        got = consume_messages(bootstrap_servers, topic, expect=310, timeout=60, quiet=3)
        assert sorted(str(message_id(m)) for m in got) == sorted(map(str, [*ids, *later]))
    finally:
        engine.dispose()
