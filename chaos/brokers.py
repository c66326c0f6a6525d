"""Which Kafka node a broker fault stops: on a cluster, found by role when the fault lands.

Leadership and coordination move with every election, so the schedule names a role (the
node leading most of the workload's partitions, or the one coordinating most of the relays'
transactions) and the run looks it up at the moment of the fault through the nodes' plain
listeners, which network faults do not touch.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from confluent_kafka import KafkaException

from outbox.chaos.relays import transactional_prefix
from outbox.chaos.schedule import Fault
from outbox.chaos.service import GROUP
from outbox.chaos.stack import ChaosStack
from outbox.chaos.writers import TOPICS
from outbox.devstack.cluster import KafkaCluster
from outbox.devstack.kafka import KafkaBroker
from outbox.relay.config import EXACTLY_ONCE
from outbox.schema import SHARD_COUNT


@dataclass(frozen=True)
class BrokerTarget:
    """The nodes a fault stops, and why those (for the fault log)."""

    nodes: list[KafkaBroker]
    why: str


def broker_target(stack: ChaosStack, fault: Fault, mode: str, run_id: str) -> BrokerTarget:
    """The nodes ``fault`` (a ``broker_restart`` or ``brokers_down``) stops now."""
    cluster = stack.cluster
    if cluster is None:
        return BrokerTarget(stack.kafka_nodes, "the broker")
    if fault.nodes:
        ids = ", ".join(map(str, fault.nodes))
        return BrokerTarget([cluster.node(n) for n in fault.nodes], f"nodes {ids}")
    try:
        node_id, why = _node_in_role(cluster, fault.broker or "leader", mode, run_id)
    except (KafkaException, KeyError) as exc:  # no answer: any node still makes a fault
        node_id, why = cluster.nodes[0].node_id, f"no role known ({exc}); the first node"
    return BrokerTarget([cluster.node(node_id)], f"node {node_id}: {why}")


def stop_nodes(nodes: list[KafkaBroker], how: str) -> None:
    """Stop ``nodes`` at once: killed (``kill``), or each shutting down in a controlled way
    (``term``) side by side, as two nodes failing together do."""
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        stops = [pool.submit(node.kill if how == "kill" else node.stop) for node in nodes]
    for stop in stops:
        stop.result()  # raises what a stop raised


def _node_in_role(cluster: KafkaCluster, role: str, mode: str, run_id: str) -> tuple[int, str]:
    if role == "coordinator" and mode == EXACTLY_ONCE:
        ids = [f"{transactional_prefix(run_id)}-{shard}" for shard in range(SHARD_COUNT)]
        counted = Counter(cluster.transaction_coordinators(ids).values())
        node_id = _most(counted)
        return node_id, f"coordinates {counted[node_id]} of the {len(ids)} shards' transactions"
    if role == "coordinator":
        node_id = cluster.group_coordinator(GROUP)
        if node_id >= 0:
            return node_id, f"coordinates the consumer group {GROUP}"
    counted = Counter(leader for topic in TOPICS for leader in cluster.leaders(topic).values())
    node_id = _most(counted)
    return node_id, f"leads {counted[node_id]} of {counted.total()} workload partitions"


def _most(counted: Counter[int]) -> int:
    """The node counted most often (the lowest id on a tie); -1, no leader, never."""
    live = {node: count for node, count in counted.items() if node >= 0}
    if not live:
        raise KeyError("no node leads any of them")
    return min(live, key=lambda node: (-live[node], node))
