"""The inbox under faults, on the real stack: consumers killed (-9) mid-batch and restarted,
consumers joining and leaving (rebalances), a broker restart, a PostgreSQL restart, a relay
that sends everything twice. Each business effect (a ledger row) must happen exactly once."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.postgres import PostgresServer
from outbox.inbox import InboxRunner
from tests import inbox_app
from tests.inbox_helpers import (
    assert_exactly_once,
    assert_partition_order,
    consumer_config,
    ledger_count,
    metric,
    prepare_database,
    produce,
    running_consumer,
    start_consumer_process,
)
from tests.relay_helpers import (
    publish_orders,
    relay_config,
    running_relay,
    statuses,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

#: Short sessions, so that the group notices a killed consumer within seconds.
FAST_GROUP = ("-X", "session.timeout.ms=6000", "-X", "heartbeat.interval.ms=500")


@pytest.fixture
def inbox_engine(outbox_url: str) -> Iterator[sa.Engine]:
    engine = prepare_database(outbox_url)
    yield engine
    engine.dispose()


def group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def test_a_consumer_killed_mid_batch_applies_nothing_twice_after_restart(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic, tmp_path: Path
) -> None:
    topic = make_topic("inbox-kill", partitions=2)
    numbers = range(3000)
    produce(bootstrap_servers, topic, numbers, sleep=0.001)
    name = group()
    log = tmp_path / "consumer.log"
    for threshold in (500, 1500):
        process = start_consumer_process(
            outbox_url, bootstrap_servers, [topic], name, "--batch-size", "200", log=log
        )
        wait_for(lambda t=threshold: ledger_count(inbox_engine) >= t, 90, f"{threshold} applied")
        process.kill()  # SIGKILL: no drain, no offset commit, a transaction cut short
        process.wait(10)
    process = start_consumer_process(outbox_url, bootstrap_servers, [topic], name, log=log)
    wait_for(lambda: ledger_count(inbox_engine) >= 3000, 120, "everything applied")
    text = process.metrics()
    assert stop_process(process) == 0
    assert_exactly_once(inbox_engine, numbers)
    assert_partition_order(inbox_engine)
    # The last consumer read from the offsets the killed ones committed, not from the start.
    assert metric(text, "outbox_inbox_processed_total") < 3000


def test_three_consumers_joining_and_leaving_apply_each_message_once(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic, tmp_path: Path
) -> None:
    topic = make_topic("inbox-rebalance", partitions=6)
    numbers = range(4000)
    produce(bootstrap_servers, topic, numbers, keys=30, sleep=0.002)
    name = group()
    log = tmp_path / "consumers.log"

    def start() -> object:
        return start_consumer_process(
            outbox_url,
            bootstrap_servers,
            [topic],
            name,
            "--batch-size",
            "100",
            *FAST_GROUP,
            log=log,
        )

    first = start()
    wait_for(lambda: ledger_count(inbox_engine) >= 400, 90, "the first consumer under way")
    second = start()
    wait_for(lambda: ledger_count(inbox_engine) >= 1000, 90, "two consumers under way")
    third = start()
    wait_for(lambda: ledger_count(inbox_engine) >= 1600, 90, "three consumers under way")
    second.kill()  # type: ignore[attr-defined]
    wait_for(lambda: ledger_count(inbox_engine) >= 2400, 90, "the others take over")
    assert stop_process(first) == 0  # type: ignore[arg-type]  # SIGTERM: drains, leaves
    wait_for(lambda: ledger_count(inbox_engine) >= 4000, 120, "everything applied")
    assert stop_process(third) == 0  # type: ignore[arg-type]
    assert_exactly_once(inbox_engine, numbers)
    assert_partition_order(inbox_engine)
    with inbox_engine.connect() as conn:
        partitions_per_consumer = conn.execute(
            sa.text("SELECT count(DISTINCT kafka_partition) FROM ledger")
        ).scalar_one()
    assert partitions_per_consumer == 6


def test_a_broker_restart_is_ridden_out(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    make_topic,
    kafka_broker: KafkaBroker,
) -> None:
    topic = make_topic("inbox-broker", partitions=3)
    numbers = range(3000)
    produce(bootstrap_servers, topic, numbers, sleep=0.002)
    inbox = inbox_app.make_inbox([topic], group())
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as runner:
        wait_for(lambda: ledger_count(inbox_engine) >= 300, 60, "the consumer under way")
        kafka_broker.stop()
        try:
            wait_for(lambda: not runner.health.kafka_ok, 60, "the consumer to see the outage")
        finally:
            kafka_broker.start()
        wait_for(lambda: ledger_count(inbox_engine) >= 3000, 120, "everything applied")
    assert_exactly_once(inbox_engine, numbers)
    assert_partition_order(inbox_engine)


def test_a_postgresql_restart_skips_nothing_and_applies_nothing_twice(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    make_topic,
    postgres_server: PostgresServer,
) -> None:
    topic = make_topic("inbox-pg", partitions=3)
    numbers = range(3000)
    produce(bootstrap_servers, topic, numbers, sleep=0.002)
    inbox = inbox_app.make_inbox([topic], group())
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as runner:
        wait_for(lambda: ledger_count(inbox_engine) >= 300, 60, "the consumer under way")
        postgres_server.stop("immediate")  # a crash: open transactions are lost
        try:
            wait_for(lambda: not runner.health.database_ok, 60, "the consumer to see the outage")
        finally:
            postgres_server.start()
        wait_for(lambda: ledger_count(inbox_engine) >= 3000, 120, "everything applied")
        wait_for(lambda: runner.health.database_ok, 30, "the consumer to recover")
    assert_exactly_once(inbox_engine, numbers)
    assert_partition_order(inbox_engine)


def test_everything_a_relay_sends_twice_is_applied_once(
    inbox_engine: sa.Engine, engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    """Outbox in one service, inbox in another: a relay that dies between Kafka's
    acknowledgement and its mark leaves the rows pending, and the next relay sends them all
    again. The copies carry the same outbox-id, and the inbox skips them."""
    topic = make_topic("inbox-relay", partitions=3)
    ids = publish_orders(engine, topic, 1000, keys=20)
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: statuses(engine) == {"sent": 1000}, 60, "all sent")
    with engine.begin() as conn:  # what a relay killed before its mark leaves behind
        conn.execute(sa.text("UPDATE outbox SET status = 'pending', sent_at = NULL"))
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: statuses(engine) == {"sent": 1000}, 60, "all sent again")
    inbox = inbox_app.make_inbox([topic], group())
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as runner:
        wait_for(lambda: runner.metrics.duplicates.labels(topic)._value.get() == 1000, 60, "copies")
        assert runner.metrics.processed.labels(topic)._value.get() == 1000
    with inbox_engine.connect() as conn:
        applied = set(conn.execute(sa.text("SELECT message_id FROM ledger")).scalars())
    assert applied == {str(i) for i in ids}
    assert_exactly_once(inbox_engine, range(1000))
    assert_partition_order(inbox_engine)


def test_a_consumer_stopped_while_kafka_does_not_answer_still_stops(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    make_topic,  # type: ignore[no-untyped-def]
    faulty_kafka,  # type: ignore[no-untyped-def]
) -> None:
    """Leaving the group waits for its coordinator; with Kafka silent (a broker gone) a
    SIGTERM must still end the consumer, not hang until a supervisor kills it (seen in a
    chaos run: a consumer stopped after a broker kill was killed 60 s later)."""
    import threading

    from outbox.inbox.runner import LEAVE_TIMEOUT, InboxRunner

    topic = make_topic("inbox-leave", partitions=3)
    numbers = range(300)
    produce(bootstrap_servers, topic, numbers)
    inbox = inbox_app.make_inbox([topic], group())
    config = consumer_config(outbox_url, f"127.0.0.1:{faulty_kafka.listen_port}")
    runner = InboxRunner(inbox, config)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: ledger_count(inbox_engine) >= 300, 60, "everything applied")
        faulty_kafka.stall()
        runner.stop()
        thread.join(LEAVE_TIMEOUT + 20)
        assert not thread.is_alive(), "the consumer did not stop while Kafka was silent"
    finally:
        faulty_kafka.heal()
        runner.stop()
        thread.join(60)
    assert_exactly_once(inbox_engine, numbers)


def planned_left(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT sum(failures_left) FROM fail_plan")).scalar_one())


def caught_up(runner: InboxRunner) -> bool:
    """The runner has read its partitions to their ends (its lag metric is 0 for each)."""
    samples = [
        s.value
        for metric in runner.metrics.lag.collect()
        for s in metric.samples
        if s.name.endswith("_lag")
    ]
    return bool(samples) and not any(samples)


def test_a_consumer_stopped_while_its_batch_waits_for_the_database_skips_nothing(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    """A batch's connection breaks, and the runner waits out a backoff before trying it
    again; meanwhile it has read the next records. Stopped in that backoff, it must give up
    the batch in hand *and* what it read after it: applying the later records and committing
    their offsets would skip the earlier ones for good."""
    from sqlalchemy.orm import Session

    from outbox.inbox import Inbox, InboxMessage

    topic = make_topic("inbox-stop-outage")
    numbers = range(40)
    with inbox_engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO fail_plan VALUES (3, 1)"))  # n=3 breaks it once
    produce(bootstrap_servers, topic, numbers, keys=1, extra={3: {"fail": True}})
    name = group()
    inbox = Inbox(group=name)

    @inbox.handler(topic)
    def on_order(message: InboxMessage, session: Session) -> None:
        if message.value.get("fail"):
            with session.get_bind().connect() as conn:  # type: ignore[union-attr]
                left = conn.execute(inbox_app._FAIL, {"n": message.value["n"]}).first()
                conn.commit()
            if left is not None:  # the connection breaks (as in a PostgreSQL restart)
                session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))
        session.execute(inbox_app._INSERT, inbox_app.apply(message, session))

    config = consumer_config(
        outbox_url, bootstrap_servers, batch_size=10, backoff_base=6.0, backoff_max=6.0
    )
    with running_consumer(inbox, config) as runner:
        wait_for(lambda: planned_left(inbox_engine) == 0, 60, "the connection broken")
        time.sleep(1.0)  # in the backoff (3 to 6 s); the next records are read meanwhile
        assert not runner.health.database_ok
        runner.stop()
    # A second consumer of the group starts where the first one's offsets say.
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as second:
        wait_for(lambda: second.offsets.pending == {} and caught_up(second), 60, "caught up")
    assert_exactly_once(inbox_engine, numbers)
    assert_partition_order(inbox_engine)
