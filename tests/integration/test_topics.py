"""`outbox topics create|describe|check` on the session's single broker (the local stack) and on
a three-node cluster (replication factor 3): defaults, a declared-topics file, and `check`
failing, naming the topic, when it is missing or under-replicated."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from confluent_kafka.admin import AdminClient, ConfigResource

from outbox import Outbox
from outbox.cli import main
from outbox.devstack import LocalStack, StackError
from outbox.devstack.cluster import KafkaCluster
from tests.conftest import server_unavailable
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


def topics(*args: str) -> Result:
    return CliRunner().invoke(main, ["topics", *args])


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def topic_settings(bootstrap: str, name: str) -> dict[str, str]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    [future] = admin.describe_configs([ConfigResource("topic", name)]).values()
    return {key: entry.value for key, entry in future.result(30).items()}


def test_create_describe_and_check_on_the_single_broker(  # type: ignore[no-untyped-def]
    bootstrap_servers, outbox_url, engine, tmp_path: Path
) -> None:
    orders, payments, absent = unique("orders"), unique("payments"), unique("absent")
    declared = tmp_path / "topics.toml"
    declared.write_text(
        f'[defaults]\nretention = "3d"\n\n[topics.{orders}]\npartitions = 4\n\n'
        f'[topics.{payments}]\nconfig = {{ "compression.type" = "lz4" }}\n'
    )
    base = ["--bootstrap-servers", bootstrap_servers]
    too_many = topics("create", *base, "--replication-factor", "3", orders)
    assert too_many.exit_code == 2 and "needs 3 brokers, the cluster has 1" in too_many.output

    tried = topics("create", *base, "--dry-run", orders)
    assert tried.exit_code == 0 and f"{orders}: would create: 12 partitions" in tried.output
    assert f"{orders}  MISSING" in topics("describe", *base, orders).output

    created = topics("create", *base, "--file", str(declared))
    assert created.exit_code == 0, created.output
    assert f"{orders}: created: 4 partitions, 1 replicas, min.insync.replicas 1" in created.output
    assert f"{payments}: created: 12 partitions" in created.output
    again = topics("create", *base, "--file", str(declared))
    assert f"{orders}: exists (left as it is)" in again.output
    settings = topic_settings(bootstrap_servers, payments)
    assert settings["retention.ms"] == str(3 * 86_400_000)
    assert settings["compression.type"] == "lz4"
    assert settings["max.message.bytes"] == "1048588"

    described = topics("describe", *base, orders, absent)
    assert described.exit_code == 0, described.output
    assert "4 partitions, 1 replicas (in sync), min.insync.replicas 1, retention 3d" in (
        described.output
    )
    assert f"{absent}  MISSING" in described.output

    ok = topics("check", *base, "--file", str(declared))
    assert ok.exit_code == 0 and "2 topic(s) ok" in ok.output, ok.output

    # The table's topics: a message waiting for a topic nobody created fails the check.
    with Outbox(engine).transaction() as tx:
        tx.publish(orders, {"n": 1})
        tx.publish(absent, {"n": 2})
    from_table = topics("check", *base, "--database-url", outbox_url)
    assert from_table.exit_code == 1
    assert f"{absent}  MISSING" in from_table.output
    assert f"check failed: {absent} missing" in from_table.output
    assert f"{orders}  ok" in from_table.output


def test_check_tells_a_missing_topic_from_kafka_out_of_reach(bootstrap_servers: str) -> None:
    absent = unique("absent")
    missing = topics("check", "--bootstrap-servers", bootstrap_servers, absent)
    assert missing.exit_code == 1, missing.output  # it looked, and found a problem
    assert f"check failed: {absent} missing" in missing.output
    unreachable = topics("check", "--bootstrap-servers", "127.0.0.1:1", absent)
    assert unreachable.exit_code == 2, unreachable.output  # it could not look
    assert "cannot reach Kafka" in unreachable.output
    bad = topics("check", "--bootstrap-servers", bootstrap_servers)
    assert bad.exit_code == 2 and "no topic to look at" in bad.output


@pytest.fixture(scope="module")
def cluster(local_stack: LocalStack) -> Iterator[KafkaCluster]:
    stack = LocalStack.named(f"pytest-topics-{os.getpid()}", durable=False, brokers=3)
    try:
        stack.up_kafka()
    except StackError as exc:
        stack.down()
        server_unavailable("the Kafka cluster", exc)
    assert stack.cluster is not None
    yield stack.cluster
    stack.down()


def test_defaults_and_an_under_replicated_topic_on_three_nodes(cluster: KafkaCluster) -> None:
    name = unique("replicated")
    base = ["--bootstrap-servers", cluster.bootstrap_servers]
    created = topics("create", *base, "--partitions", "3", name)
    assert created.exit_code == 0, created.output
    assert "3 partitions, 3 replicas, min.insync.replicas 2, retention 7d" in created.output
    assert topic_settings(cluster.bootstrap_servers, name)["min.insync.replicas"] == "2"
    healthy = topics("check", *base, name)
    assert healthy.exit_code == 0 and f"{name}  ok" in healthy.output, healthy.output
    assert "warning" not in healthy.output
    lone = unique("lone")
    assert topics("create", *base, "--replication-factor", "1", lone).exit_code == 0
    risky = topics("check", *base, lone)
    assert risky.exit_code == 0, risky.output  # a warning, not a failure
    assert "warning: 1 replica(s) on a cluster of 3 brokers" in risky.output

    node = cluster.nodes[-1]
    node.stop()
    try:
        results: list[Result] = []

        def flagged() -> bool:
            results.append(topics("check", *base, name))
            return results[-1].exit_code == 1

        wait_for(flagged, 60, "check to see the stopped node's replicas out of sync")
        failed = results[-1]
        assert f"{name}  UNDER-REPLICATED" in failed.output
        assert "2 of 3 replicas in sync" in failed.output
        assert f"check failed: {name} under-replicated" in failed.output
    finally:
        cluster.start()
    wait_for(lambda: topics("check", *base, name).exit_code == 0, 90, "the node back in sync")
