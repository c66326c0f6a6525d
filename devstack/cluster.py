"""A Kafka cluster of combined broker + controller nodes in KRaft mode, on 127.0.0.1.

Production Kafka replicates: the failures that matter to an idempotent or transactional
producer (leader elections, in-sync replicas shrinking, a transaction coordinator moving)
only happen with several nodes. Every node here is both a broker and a controller voter;
internal and new topics get one replica per node, and ``min.insync.replicas`` is one less,
so one node may be down without stopping writes and two stop them (never losing one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from outbox.devstack.kafka import (
    INTERNAL_PARTITIONS,
    START_TIMEOUT,
    KafkaBroker,
    new_cluster_id,
)
from outbox.devstack.procs import StackError, wait_until

#: Heap per node: three nodes fit the machine beside PostgreSQL, the relays and Spark.
CLUSTER_HEAP = "-Xmx512m"
#: A coordinator is the leader of a partition of one of these.
TRANSACTION_STATE = "__transaction_state"
CONSUMER_OFFSETS = "__consumer_offsets"


def java_string_hash(text: str) -> int:
    """Java's ``String.hashCode`` (a signed 32-bit int), which Kafka uses to place a
    transactional id or a group id on a partition of its internal topic."""
    data = text.encode("utf-16-be")
    value = 0
    for at in range(0, len(data), 2):  # over UTF-16 code units, as Java's char
        value = (31 * value + int.from_bytes(data[at : at + 2], "big")) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def coordinator_partition(key: str, partitions: int = INTERNAL_PARTITIONS) -> int:
    """The internal-topic partition that holds ``key``'s state (Kafka's ``Utils.abs`` of the
    hash, modulo the partition count): its leader is ``key``'s coordinator."""
    hashed = java_string_hash(key)
    return (0 if hashed == -(1 << 31) else abs(hashed)) % partitions


@dataclass
class KafkaCluster:
    """``nodes`` share one cluster id and one controller quorum (node ids 1..N)."""

    nodes: list[KafkaBroker]
    cluster_id: str = field(default_factory=new_cluster_id)

    @classmethod
    def create(
        cls, root: Path, jars: list[Path], ports: list[tuple[int, int]], cluster_id: str | None
    ) -> KafkaCluster:
        """Nodes under ``root/node-<id>`` on the given (port, controller port) pairs."""
        cluster_id = cluster_id or new_cluster_id()
        nodes = [
            KafkaBroker(
                root=root / f"node-{number}",
                jars=jars,
                port=port,
                controller_port=controller,
                node_id=number,
                cluster_id=cluster_id,
                replication=len(ports),
                heap=CLUSTER_HEAP,
            )
            for number, (port, controller) in enumerate(ports, 1)
        ]
        cluster = cls(nodes, cluster_id)
        cluster.name_voters()
        return cluster

    def name_voters(self) -> None:
        """Tell every node the controller quorum (``id@host:port,...``): again whenever a
        node's controller port changes."""
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        for node in self.nodes:
            node.voters = voters

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    def node(self, node_id: int) -> KafkaBroker:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no Kafka node {node_id}")

    def running(self) -> bool:
        return all(node.running() for node in self.nodes)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start every node that is not running, then wait up to ``timeout`` seconds for all:
        the controllers elect a leader only once a majority of them runs."""
        for node in self.nodes:
            node.launch()
        deadline = time.monotonic() + timeout
        try:
            for node in self.nodes:
                node.wait_ready(max(1.0, deadline - time.monotonic()))
            # A node answers metadata as soon as it runs, before the others have registered
            # with the controllers: until every one has, a topic with one replica per node
            # cannot be created.
            wait_until(
                lambda: self._registered() == len(self.nodes),
                max(1.0, deadline - time.monotonic()),
                f"all {len(self.nodes)} Kafka nodes to register",
            )
        except StackError:
            self.stop()
            raise

    def _registered(self) -> int:
        """How many nodes the cluster's metadata lists as live brokers now."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        try:
            return len(admin.list_topics(timeout=2).brokers)
        except Exception:  # not answering yet is not registered
            return 0

    def stop(self) -> None:
        errors = []
        for node in self.nodes:
            try:
                node.stop()
            except StackError as exc:
                errors.append(str(exc))
        if errors:
            raise StackError("; ".join(errors))

    def leader_of(self, topic: str, partition: int = 0) -> int:
        """The node id leading ``topic``'s ``partition`` now (-1 while it has none)."""
        return self.leaders(topic).get(partition, -1)

    def leaders(self, topic: str) -> dict[int, int]:
        """Partition -> the node id leading it now (-1 while it has none)."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        described = admin.list_topics(topic, timeout=10).topics[topic]
        return {number: int(p.leader) for number, p in described.partitions.items()}

    def transaction_coordinators(self, transactional_ids: list[str]) -> dict[str, int]:
        """Transactional id -> the node coordinating its transactions now."""
        leaders = self.leaders(TRANSACTION_STATE)
        return {
            tid: leaders.get(coordinator_partition(tid, len(leaders)), -1)
            for tid in transactional_ids
        }

    def group_coordinator(self, group: str) -> int:
        """The node coordinating consumer group ``group`` now."""
        leaders = self.leaders(CONSUMER_OFFSETS)
        return leaders.get(coordinator_partition(group, len(leaders)), -1)
