"""Pure logic of the local stack: ports, configuration, where data lives, jar caching."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from outbox.devstack import maven, procs
from outbox.devstack.kafka import (
    CONCURRENT_COLLECTOR,
    FALLBACK_COLLECTOR,
    KafkaBroker,
    collector,
)
from outbox.devstack.postgres import data_root_for
from outbox.devstack.procs import free_port, pid_alive
from outbox.devstack.stack import StackInfo, _usable_port


def test_free_port_can_be_bound_on_loopback() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_usable_port_keeps_a_free_recorded_port_and_replaces_a_busy_one() -> None:
    recorded = free_port()
    assert _usable_port(recorded) == recorded
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        replacement = _usable_port(taken)
    assert replacement not in (taken, 0)
    assert _usable_port(recorded, avoid=recorded) != recorded


def test_broker_config_listens_on_loopback_without_topic_auto_creation(tmp_path: Path) -> None:
    broker = KafkaBroker(root=tmp_path, jars=[], port=19092, controller_port=19093)
    config = dict(line.split("=", 1) for line in broker._server_properties().splitlines() if line)
    assert config["auto.create.topics.enable"] == "false"
    assert config["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert config["process.roles"] == "broker,controller"
    assert config["transaction.state.log.replication.factor"] == "1"
    assert config["transaction.state.log.min.isr"] == "1"
    assert broker.bootstrap_servers == "127.0.0.1:19092"


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the cluster to another user")
def test_cluster_moves_out_of_a_folder_the_postgres_user_cannot_reach(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    open_dir = Path("/tmp") / f"outbox-open-{os.getpid()}"
    open_dir.mkdir(mode=0o755, exist_ok=True)
    try:
        moved = data_root_for(private / "run")
        assert moved.parent == Path("/tmp")
        assert moved.name.startswith("outbox-postgres-")
        assert moved == data_root_for(private / "run")  # stable, so a restart finds its data
        assert data_root_for(open_dir / "run") == open_dir / "run" / "postgres"
    finally:
        open_dir.rmdir()


def test_resolved_jars_are_reused_without_maven(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    jars_dir = tmp_path / "jars"
    jars_dir.mkdir()
    (jars_dir / "a.jar").write_bytes(b"")
    pom = maven.POM_ROOT / "kafka" / "pom.xml"
    import hashlib

    digest = hashlib.sha256(pom.read_bytes() + maven.SETTINGS.read_bytes()).hexdigest()
    (jars_dir / ".resolved").write_text(digest)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no mvn to be found
    assert maven.resolve_jars("kafka", jars_dir) == [jars_dir / "a.jar"]

    (jars_dir / ".resolved").write_text("stale")  # the POM changed: Maven is needed again
    with pytest.raises(maven.StackError, match="Maven"):
        maven.resolve_jars("kafka", jars_dir)


def test_pid_alive_tells_a_finished_process_from_a_live_one() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert not pid_alive(pid)
    assert pid_alive(os.getpid())
    assert not pid_alive(None)


def test_stack_info_exports_the_settings_as_environment_variables() -> None:
    info = StackInfo("postgresql+psycopg://u:p@127.0.0.1:5/db", "127.0.0.1:9", ("/a.jar", "/b.jar"))
    assert info.as_env() == {
        "OUTBOX_DATABASE_URL": "postgresql+psycopg://u:p@127.0.0.1:5/db",
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9",
        "OUTBOX_SPARK_JARS": "/a.jar,/b.jar",
    }


def test_kafka_cluster_ids_never_look_like_an_option() -> None:
    import base64

    from outbox.devstack.kafka import new_cluster_id

    ids = [new_cluster_id() for _ in range(2000)]  # about 31 would start with '-' unguarded
    assert not any(cluster_id.startswith("-") for cluster_id in ids)
    assert all(len(base64.urlsafe_b64decode(i + "==")) == 16 for i in ids)


def test_cluster_nodes_share_one_quorum_and_replicate_everything(tmp_path: Path) -> None:
    from outbox.devstack.cluster import KafkaCluster

    cluster = KafkaCluster.create(
        tmp_path, [], [(19092, 19093), (19094, 19095), (19096, 19097)], cluster_id=None
    )
    assert cluster.bootstrap_servers == "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096"
    configs = [
        dict(line.split("=", 1) for line in node._server_properties().splitlines() if line)
        for node in cluster.nodes
    ]
    assert [c["node.id"] for c in configs] == ["1", "2", "3"]
    voters = "1@127.0.0.1:19093,2@127.0.0.1:19095,3@127.0.0.1:19097"
    assert all(c["controller.quorum.voters"] == voters for c in configs)
    assert {node.cluster_id for node in cluster.nodes} == {cluster.cluster_id}
    for config in configs:
        assert config["default.replication.factor"] == "3"
        assert config["min.insync.replicas"] == "2"
        assert config["transaction.state.log.replication.factor"] == "3"
        assert config["transaction.state.log.min.isr"] == "2"
        assert config["offsets.topic.replication.factor"] == "3"
    assert len({node.root for node in cluster.nodes}) == 3


def test_coordinators_are_placed_as_kafka_places_them() -> None:
    from outbox.devstack.cluster import coordinator_partition, java_string_hash

    # Values of Java's String.hashCode, from jshell.
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("chaos-eos-7-abcdef-13") == -334328155
    assert java_string_hash("\u00e9\u65e5\u672c") == 1058960  # beyond ASCII: UTF-16 units
    assert java_string_hash("") == 0
    assert coordinator_partition("chaos-eos-7-abcdef-13") == 334328155 % 8
    assert coordinator_partition("hello", partitions=50) == 99162322 % 50
    # Integer.MIN_VALUE has no absolute value in Java: Kafka's Utils.abs makes it 0.
    assert java_string_hash("polygenelubricants") == -(2**31)
    assert coordinator_partition("polygenelubricants") == 0


def test_a_stack_refuses_to_change_its_broker_count_while_recorded(tmp_path: Path) -> None:
    from outbox.devstack import LocalStack, StackError

    run = tmp_path / "run"
    run.mkdir()
    (run / "state.json").write_text('{"kafka": {"port": 19092, "controller_port": 19093}}')
    with pytest.raises(StackError, match="runs 1 Kafka node"):
        LocalStack(run, brokers=3)
    assert LocalStack(run).brokers == 1


def test_free_ports_lie_outside_the_ephemeral_range_and_are_not_handed_out_twice() -> None:
    low, _ = procs._ephemeral_range()
    ports = [procs.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(port < low for port in ports)  # no outgoing connection can take them first
    for port in ports[:5]:  # and each can be listened on
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


def test_a_broker_runs_zgc_where_the_jvm_has_it_and_g1_where_it_does_not(tmp_path: Path) -> None:
    java = shutil.which("java")
    assert java is not None, "the local stack needs Java"
    assert collector(java) == CONCURRENT_COLLECTOR  # JDK 17 has ZGC on Linux x64 and aarch64
    # A JVM built without ZGC refuses the option, as JDK 17 does on ppc64le or s390x.
    refusing = tmp_path / "java"
    refusing.write_text(
        '#!/bin/sh\ncase "$1" in -XX:+UseZGC) echo "Unrecognized VM option" >&2; exit 1;; esac\n'
    )
    refusing.chmod(0o755)
    assert collector(str(refusing)) == FALLBACK_COLLECTOR
