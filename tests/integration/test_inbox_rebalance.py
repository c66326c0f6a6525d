"""Offsets across rebalances, on the real stack. While its group rebalances, a consumer keeps
applying the partitions it owns (their offset commits are refused for a while:
ILLEGAL_GENERATION, REBALANCE_IN_PROGRESS); what it applied is committed once the group
takes commits again, and before its partitions go, also when it stops in the middle of a
rebalance, so that the next owner reads none of it again."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, ConsumerGroupState, TopicPartition
from confluent_kafka.admin import AdminClient

from outbox.chaos.proxy import FaultProxy
from outbox.inbox import InboxRunner
from tests import inbox_app
from tests.inbox_helpers import consumer_config, ledger, ledger_count, prepare_database, produce
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration

TP = tuple[str, int]

#: The runner's group settings: a short session, frequent heartbeats.
FAST = {"session.timeout.ms": "6000", "heartbeat.interval.ms": "200"}


@pytest.fixture
def inbox_engine(outbox_url: str) -> Iterator[sa.Engine]:
    engine = prepare_database(outbox_url)
    yield engine
    engine.dispose()


@contextmanager
def group_member(bootstrap: str, group: str, topic: str, **settings: str) -> Iterator[set[TP]]:
    """A plain member of ``group`` that takes its share of partitions and reads nothing
    (its thread polls only to serve the rebalances); yields the partitions it holds. Only
    that thread touches the consumer: a call from another one while it polls can hang."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "partition.assignment.strategy": "cooperative-sticky",
            **settings,
        }
    )
    held: set[TP] = set()

    def assigned(_: Consumer, partitions: list[TopicPartition]) -> None:
        held.update((p.topic, p.partition) for p in partitions)

    def revoked(_: Consumer, partitions: list[TopicPartition]) -> None:
        held.difference_update((p.topic, p.partition) for p in partitions)

    consumer.subscribe([topic], on_assign=assigned, on_revoke=revoked, on_lost=revoked)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            consumer.poll(0.1)
            consumer.pause(consumer.assignment())  # never read: only hold partitions

    thread = threading.Thread(target=serve, name="group-member", daemon=True)
    thread.start()
    try:
        yield held
    finally:
        stop.set()
        thread.join(30)
        consumer.close()


@contextmanager
def running(runner: InboxRunner) -> Iterator[InboxRunner]:
    thread = threading.Thread(target=runner.run, name="inbox", daemon=True)
    thread.start()
    try:
        yield runner
    finally:
        runner.stop()
        thread.join(120)
        assert not thread.is_alive(), "the runner did not stop"


def group_state(admin: AdminClient, group: str) -> object:
    [future] = admin.describe_consumer_groups([group]).values()
    return future.result(30).state


def applied_ends(engine: sa.Engine) -> dict[TP, int]:
    """Per partition, the offset after the last record the ledger has."""
    ends: dict[TP, int] = {}
    for row in ledger(engine):
        tp = (row.topic, row.kafka_partition)
        ends[tp] = max(ends.get(tp, 0), row.kafka_offset + 1)
    return ends


def committed_offsets(bootstrap: str, group: str, partitions: list[TP]) -> dict[TP, int]:
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        found = reader.committed([TopicPartition(t, p) for t, p in partitions], timeout=30)
    finally:
        reader.close()
    return {(tp.topic, tp.partition): tp.offset for tp in found}


def applied_in(engine: sa.Engine, partitions: set[TP]) -> int:
    """How many records of ``partitions`` the ledger has (a runner that was alone in the group
    for a moment may have applied records of partitions it no longer owns)."""
    return sum(1 for row in ledger(engine) if (row.topic, row.kafka_partition) in partitions)


def topic_ends(bootstrap: str, partitions: set[TP]) -> int:
    """How many records ``partitions`` hold (from offset 0)."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"ends-{uuid.uuid4().hex}"})
    try:
        return sum(
            reader.get_watermark_offsets(TopicPartition(t, p), timeout=30)[1] for t, p in partitions
        )
    finally:
        reader.close()


def test_a_consumer_keeps_applying_while_its_group_rebalances_and_commits_afterwards(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    faulty_kafka: FaultProxy,
    make_topic,
) -> None:
    """A member of the group goes silent; a new member joins. The group waits for the silent
    one until its session times out (15 s), and until then the runner's offset commits are
    refused (they wait behind its own join, then come back ILLEGAL_GENERATION). The runner
    must go on applying the partitions it owns meanwhile, not wait behind the join, and
    commit their offsets once the group has its new generation."""
    topic = make_topic("inbox-rebalance-busy", partitions=4)
    group = f"g-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    silent = f"127.0.0.1:{faulty_kafka.listen_port}"
    produce(bootstrap_servers, topic, range(400), keys=40)
    member = {"session.timeout.ms": "15000", "heartbeat.interval.ms": "500"}
    config = consumer_config(outbox_url, bootstrap_servers, kafka=FAST)
    try:
        with (
            group_member(silent, group, topic, **member) as other,
            running(InboxRunner(inbox_app.make_inbox([topic], group), config)),
        ):
            wait_for(lambda: len(other) == 2, 60, "the partitions shared")
            wait_for(lambda: group_state(admin, group) == ConsumerGroupState.STABLE, 60, "stable")
            mine = {(topic, p) for p in range(4)} - other
            caught_up = topic_ends(bootstrap_servers, mine)
            wait_for(lambda: applied_in(inbox_engine, mine) == caught_up, 60, "caught up")
            faulty_kafka.stall()
            with group_member(bootstrap_servers, group, topic):  # starts a rebalance
                wait_for(
                    lambda: group_state(admin, group) != ConsumerGroupState.STABLE,
                    30,
                    "a rebalance under way",
                )
                time.sleep(1.0)  # the runner's heartbeat has seen it: its join is pending
                produce(bootstrap_servers, topic, range(400, 800), keys=40)
                expected = topic_ends(bootstrap_servers, mine)
                wait_for(
                    lambda: applied_in(inbox_engine, mine) >= expected, 60, "applied meanwhile"
                )
                assert group_state(admin, group) != ConsumerGroupState.STABLE, (
                    "the runner applied the new records only after the rebalance"
                )
                wait_for(
                    lambda: group_state(admin, group) == ConsumerGroupState.STABLE, 60, "stable"
                )

                def all_committed() -> bool:
                    ends = applied_ends(inbox_engine)
                    return committed_offsets(bootstrap_servers, group, sorted(ends)) == ends

                wait_for(all_committed, 60, "the refused offsets committed")
    finally:
        faulty_kafka.heal()


def test_a_consumer_stopped_in_the_middle_of_a_rebalance_commits_what_it_applied(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    faulty_kafka: FaultProxy,
    make_topic,
) -> None:
    """The group's leader is a member behind a slow network, so a rebalance takes seconds:
    the runner's join waits for the leader's, then the group waits for the leader's
    assignment. The runner is stopped in that window; what it applied must be the group's
    committed offsets afterwards."""
    topic = make_topic("inbox-rebalance-stop", partitions=4)
    group = f"g-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    slow = f"127.0.0.1:{faulty_kafka.listen_port}"
    produce(bootstrap_servers, topic, range(400), keys=40)
    leader_settings = {"session.timeout.ms": "45000", "heartbeat.interval.ms": "500"}
    config = consumer_config(outbox_url, bootstrap_servers, kafka=FAST)
    # The first member of a group leads it while it stays in the group.
    with group_member(slow, group, topic, **leader_settings) as leader:
        wait_for(lambda: len(leader) == 4, 60, "the leader's assignment")
        try:
            with running(InboxRunner(inbox_app.make_inbox([topic], group), config)) as runner:
                wait_for(lambda: ledger_count(inbox_engine) > 0, 60, "the runner under way")
                faulty_kafka.set_latency(1000)
                with group_member(bootstrap_servers, group, topic):  # starts a rebalance
                    wait_for(
                        lambda: group_state(admin, group) != ConsumerGroupState.STABLE,
                        30,
                        "a rebalance under way",
                    )
                    time.sleep(1.0)  # the runner's heartbeat has seen it: its join is pending
                    before = ledger_count(inbox_engine)
                    produce(bootstrap_servers, topic, range(400, 800), keys=40)
                    wait_for(lambda: ledger_count(inbox_engine) > before, 30, "more applied")
                    runner.stop()
        finally:
            faulty_kafka.set_latency(0)
    ends = applied_ends(inbox_engine)
    assert committed_offsets(bootstrap_servers, group, sorted(ends)) == ends


def test_a_partition_waiting_for_a_retry_is_read_again_after_a_rebalance(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    """A partition paused while its failing record waits for a retry is revoked and
    assigned again (the eager protocol revokes everything on each rebalance): it must be
    read again, not stay paused for good."""
    topic = make_topic("inbox-rebalance-paused")
    other_topic = make_topic("inbox-rebalance-other")
    group = f"g-{uuid.uuid4().hex[:8]}"
    with inbox_engine.begin() as conn:
        # n=3 fails on the fast way and alone: its partition waits for a retry.
        conn.execute(sa.text("INSERT INTO fail_plan VALUES (3, 2)"))
    produce(bootstrap_servers, topic, range(20), keys=1, extra={3: {"fail": True}})
    eager = {"partition.assignment.strategy": "range"}
    # A backoff far longer than the test waits: only the rebalance lets n=3 be read again.
    config = consumer_config(
        outbox_url, bootstrap_servers, kafka={**FAST, **eager}, backoff_base=60, backoff_max=60
    )
    runner = InboxRunner(inbox_app.make_inbox([topic], group), config)
    with running(runner):
        wait_for(lambda: bool(runner._waiting), 60, "the partition paused for a retry")
        # A member reading another topic joins: the runner's partition is revoked and
        # assigned back to it.
        with group_member(bootstrap_servers, group, other_topic, **FAST, **eager) as other:
            wait_for(lambda: len(other) == 1, 60, "the other member's partition")
            wait_for(lambda: ledger_count(inbox_engine) == 20, 25, "everything applied")


@pytest.mark.serial
def test_a_consumer_behind_a_slow_link_stays_ready_while_its_commits_are_answered(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    faulty_kafka: FaultProxy,
    make_topic,
) -> None:
    """Offsets are committed asynchronously after each batch. Behind a link slower than a
    batch, a new commit goes out before the last one is answered, every time: the runner
    must still count Kafka as in reach while the answers keep coming, not as blocked on one
    call that never ends."""
    topic = make_topic("inbox-slow-link", partitions=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = consumer_config(outbox_url, f"127.0.0.1:{faulty_kafka.listen_port}")
    runner = InboxRunner(inbox_app.make_inbox([topic], group), config)
    stop = threading.Event()

    def keep_producing() -> None:
        n = 0
        while not stop.is_set():
            produce(bootstrap_servers, topic, range(n, n + 10))
            n += 10
            time.sleep(0.02)

    producing = threading.Thread(target=keep_producing, name="producer", daemon=True)
    try:
        with running(runner):
            producing.start()
            wait_for(lambda: ledger_count(inbox_engine) > 0, 60, "the runner under way")
            wait_for(lambda: runner.health.kafka_ok, 30, "Kafka in reach")
            faulty_kafka.set_latency(150)
            not_ready = []
            deadline = time.monotonic() + 12
            while time.monotonic() < deadline:
                if not runner.health.kafka_ok:
                    not_ready.append(round(deadline - time.monotonic(), 1))
                time.sleep(0.2)
            before = ledger_count(inbox_engine)
            time.sleep(1)
            assert ledger_count(inbox_engine) > before, "the runner stopped applying"
            assert not not_ready, f"Kafka counted out of reach while answering: {not_ready}"
    finally:
        stop.set()
        producing.join(30)
        faulty_kafka.set_latency(0)
