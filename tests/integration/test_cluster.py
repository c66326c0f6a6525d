"""The relay on a three-node Kafka cluster (replication factor 3, min.insync.replicas 2):
a partition leader killed -9 mid-stream, and two nodes down at once (writes stall, nothing is
lost), in both relay modes."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from outbox.devstack import LocalStack, StackError
from outbox.devstack.cluster import KafkaCluster
from outbox.devstack.topics import consume_messages, create_topics
from tests.conftest import server_unavailable
from tests.relay_helpers import (
    message_id,
    publish_orders,
    start_relay_process,
    statuses,
    stop_process,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(local_stack: LocalStack) -> Iterator[KafkaCluster]:
    # A pytest-* run: if the session is killed, the next one's start stops and removes it.
    stack = LocalStack.named(f"pytest-cluster-{os.getpid()}", durable=False, brokers=3)
    try:
        stack.up_kafka()
    except StackError as exc:
        stack.down()
        server_unavailable("the Kafka cluster", exc)
    assert stack.cluster is not None
    yield stack.cluster
    stack.down()


@pytest.fixture
def all_nodes_up(cluster: KafkaCluster) -> Iterator[KafkaCluster]:
    yield cluster
    cluster.start()  # whatever a test left down, until every node has registered again


def cluster_topic(cluster: KafkaCluster, prefix: str, partitions: int = 3) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    create_topics(cluster.bootstrap_servers, [name], partitions)
    return name


def relay_args(mode: str) -> list[str]:
    prefix = f"cl-{uuid.uuid4().hex[:8]}"
    return ["--mode", mode, "--transactional-id-prefix", prefix, "--progress-topic", f"p-{prefix}"]


def assert_each_delivered(
    cluster: KafkaCluster, topic: str, ids: list[uuid.UUID], mode: str
) -> None:
    """Every message on the topic; exactly once in exactly-once mode."""
    records = consume_messages(cluster.bootstrap_servers, topic, expect=len(ids), timeout=90)
    copies = Counter(message_id(r) for r in records)
    assert set(copies) == set(ids)
    if mode == "exactly-once":
        assert max(copies.values()) == 1


def test_topics_and_internal_topics_are_replicated_on_every_node(
    all_nodes_up: KafkaCluster,
) -> None:
    cluster = all_nodes_up
    topic = cluster_topic(cluster, "replicated")
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers})
    metadata = admin.list_topics(timeout=10)
    assert len(metadata.brokers) == 3
    for partition in metadata.topics[topic].partitions.values():
        assert sorted(partition.replicas) == [1, 2, 3]
    node = cluster.nodes[0]
    settings = dict(line.split("=", 1) for line in node._server_properties().splitlines())
    assert settings["min.insync.replicas"] == "2"
    assert settings["transaction.state.log.replication.factor"] == "3"
    assert settings["offsets.topic.replication.factor"] == "3"


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_a_partition_leader_killed_mid_stream_loses_nothing(
    mode: str, all_nodes_up: KafkaCluster, engine: sa.Engine, outbox_url: str, tmp_path: Path
) -> None:
    cluster = all_nodes_up
    topic = cluster_topic(cluster, f"leader-{mode[:5]}")
    relay = start_relay_process(
        outbox_url, cluster.bootstrap_servers, *relay_args(mode), log=tmp_path / "relay.log"
    )
    ids = publish_orders(engine, topic, 3000, keys=30)
    wait_for(lambda: statuses(engine).get("sent", 0) >= 500, 90, "the relay under way")
    leader = cluster.node(cluster.leader_of(topic, 0))
    leader.kill()
    more = publish_orders(engine, topic, 1000, keys=30, start=3000)
    wait_for(lambda: statuses(engine) == {"sent": 4000}, 120, "every row sent without the leader")
    leader.start()
    assert stop_process(relay) == 0
    assert_each_delivered(cluster, topic, ids + more, mode)


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_two_nodes_down_stall_writes_and_lose_none(
    mode: str, all_nodes_up: KafkaCluster, engine: sa.Engine, outbox_url: str, tmp_path: Path
) -> None:
    cluster = all_nodes_up
    topic = cluster_topic(cluster, f"two-down-{mode[:5]}")
    relay = start_relay_process(
        outbox_url,
        cluster.bootstrap_servers,
        *relay_args(mode),
        "--delivery-timeout-ms",
        "5000",
        # Each failed attempt backs off up to twice as long as the last; on a loaded machine the
        # nodes take a minute to come back, and an uncapped backoff would then outlast the wait.
        "--backoff-max",
        "5",
        log=tmp_path / "relay.log",
    )
    ids = publish_orders(engine, topic, 500, keys=30)
    wait_for(lambda: statuses(engine) == {"sent": 500}, 90, "the first rows sent")
    down = cluster.nodes[1:]
    for node in down:
        node.stop() if mode == "at-least-once" else node.kill()
    try:
        more = publish_orders(engine, topic, 500, keys=30, start=500)
        time.sleep(10)  # past the delivery timeout: sends fail and are retried later
        # With one replica in sync of the two required, no write can be acknowledged.
        assert statuses(engine).get("sent", 0) == 500
    finally:
        for node in down:
            node.launch()
        for node in down:
            node.wait_ready()
    back = time.monotonic()
    try:
        wait_for(lambda: statuses(engine) == {"sent": 1000}, 180, "every row sent after the stall")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stall_report(engine, tmp_path / 'relay.log')}") from None
    print(f"{mode}: every row sent {time.monotonic() - back:.1f}s after the nodes were back")
    assert relay.poll() is None, "the relay must ride the stall out, not exit"
    assert stop_process(relay, signal.SIGTERM) == 0
    assert_each_delivered(cluster, topic, ids + more, mode)


def stall_report(engine: sa.Engine, log: Path) -> str:
    """What a stalled run left: the unsent rows per shard and state, and the relay's last words."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT shard, status, attempts, lease_until IS NOT NULL, count(*),"
                " min(next_attempt_at) FROM outbox WHERE status <> 'sent'"
                " GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3"
            )
        ).all()
    lines = [line for line in log.read_text().splitlines() if "rdkafka" not in line]
    return "\n".join(
        ["unsent (shard, status, attempts, leased, rows, next attempt):"]
        + [repr(tuple(row)) for row in rows]
        + ["relay log, last lines:"]
        + lines[-60:]
    )


def test_the_coordinators_found_are_the_ones_kafka_names(all_nodes_up: KafkaCluster) -> None:
    """Chaos stops "the coordinator" by working out which node it is; Kafka's own tools and
    its group description must name the same node."""
    import subprocess

    from confluent_kafka import Consumer, Producer

    from outbox.devstack.stack import kafka_tools_jars

    cluster = all_nodes_up
    bootstrap = cluster.bootstrap_servers
    transactional_ids = [f"coord-{uuid.uuid4().hex[:8]}-{n}" for n in range(4)]
    for transactional_id in transactional_ids:  # the coordinator records each id
        producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id})
        producer.init_transactions(30)
    found = cluster.transaction_coordinators(transactional_ids)
    classpath = ":".join(str(jar) for jar in kafka_tools_jars())
    command = ["java", "-cp", classpath, "org.apache.kafka.tools.TransactionsCommand"]
    for transactional_id in transactional_ids:
        described = subprocess.run(
            [
                *command,
                "--bootstrap-server",
                bootstrap,
                "describe",
                "--transactional-id",
                transactional_id,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.splitlines()
        header, row = described[0].split(), described[1].split()
        assert int(row[header.index("CoordinatorId")]) == found[transactional_id]
    assert len(set(found.values()) - {-1}) >= 1

    group = f"coord-group-{uuid.uuid4().hex[:8]}"
    topic = cluster_topic(cluster, "coord", partitions=1)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    consumer.subscribe([topic])
    try:
        wait_for(lambda: consumer.poll(0.5) is None and bool(consumer.assignment()), 60, "a join")
        admin = AdminClient({"bootstrap.servers": bootstrap})
        described_group = admin.describe_consumer_groups([group])[group].result(30)
        assert described_group.coordinator.id == cluster.group_coordinator(group)
    finally:
        consumer.close()
