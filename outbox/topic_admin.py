"""Creating, describing and checking topics with Kafka's admin API (``outbox topics``).

Checks what the outbox's guarantees lean on: the topic exists (the relay never creates
one: a message for a missing topic goes dead), every partition has a leader, every replica
is in sync, and ``min.insync.replicas`` makes ``acks=all`` mean "on more than one broker"
(docs/topics.md, "Replication and acks=all").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
)

from outbox.errors import ConfigError
from outbox.topics import DEFAULT_REPLICATION_FACTOR, SHORTEST_SAFE_RETENTION_MS, TopicSettings

TIMEOUT = 15.0


@dataclass
class TopicState:
    """A topic as the cluster has it."""

    name: str
    partitions: int
    replication_factor: int
    #: Partitions whose in-sync replicas are fewer than their replicas.
    under_replicated: list[int] = field(default_factory=list)
    #: Partitions with fewer in-sync replicas than min.insync.replicas: writes are refused.
    below_min_insync: list[int] = field(default_factory=list)
    #: Partitions without a leader: neither read nor written.
    offline: list[int] = field(default_factory=list)
    min_insync_replicas: int | None = None
    retention_ms: int | None = None
    max_message_bytes: int | None = None
    fewest_in_sync: int = 0


@dataclass
class Finding:
    topic: str
    #: "missing", "offline", "under-replicated", "not writable", "too few replicas": the
    #: check fails; a warning does not fail it.
    problem: str | None
    detail: str
    warning: bool = False


class TopicAdmin:
    """Kafka's admin client for the ``outbox topics`` commands."""

    def __init__(self, settings: dict[str, Any]) -> None:
        # Its own log lines stay quiet: a failure reaches the operator as one error below.
        self.settings = {"log_level": 0, **settings}
        self.admin = AdminClient(self.settings)

    def _metadata(self) -> Any:
        try:
            return self.admin.list_topics(timeout=TIMEOUT)
        except KafkaException as exc:
            raise ConfigError(f"cannot reach Kafka: {_reason(exc)}") from exc

    def brokers(self) -> int:
        """How many brokers the cluster has now."""
        return len(self._metadata().brokers)

    def create(self, topics: list[TopicSettings], dry_run: bool = False) -> list[tuple[str, str]]:
        """Create each topic not there yet (resolved for this cluster); an existing topic is
        left as it is. Returns (name, what happened) per topic."""
        metadata = self._metadata()
        brokers = len(metadata.brokers)
        resolved = [topic.resolved(brokers) for topic in topics]
        outcome: dict[str, str] = {}
        new = []
        for topic in resolved:
            if topic.name in metadata.topics:
                outcome[topic.name] = "exists (left as it is)"
            else:
                assert topic.partitions is not None and topic.replication_factor is not None
                new.append(
                    NewTopic(
                        topic.name,
                        num_partitions=topic.partitions,
                        replication_factor=topic.replication_factor,
                        config=topic.topic_config(),
                    )
                )
                outcome[topic.name] = _summary(topic)
        if new:
            futures = self.admin.create_topics(
                new, operation_timeout=TIMEOUT, validate_only=dry_run
            )
            for name, future in futures.items():
                try:
                    future.result(TIMEOUT * 2)
                except KafkaException as exc:
                    if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                        outcome[name] = "exists (left as it is)"
                        continue
                    raise ConfigError(f"cannot create topic {name}: {_reason(exc)}") from exc
                verb = "would create" if dry_run else "created"
                outcome[name] = f"{verb}: {outcome[name]}"
            if not dry_run:
                self._wait_known_everywhere(metadata, [topic.topic for topic in new])
        return [(topic.name, outcome[topic.name]) for topic in resolved]

    def _wait_known_everywhere(self, metadata: Any, names: list[str]) -> None:
        """Return once every broker answers metadata with ``names`` and a leader for each
        partition: brokers learn of a new topic a moment after it is created, and a relay or
        consumer asking one that has not yet would not find it."""
        deadline = time.monotonic() + TIMEOUT
        for broker in metadata.brokers.values():
            # A client's first metadata request goes to its one bootstrap address.
            admin = AdminClient(
                {**self.settings, "bootstrap.servers": f"{broker.host}:{broker.port}"}
            )
            while True:
                try:
                    known = admin.list_topics(timeout=5).topics
                except KafkaException:
                    known = {}
                if all(
                    name in known
                    and known[name].partitions
                    and all(p.leader >= 0 for p in known[name].partitions.values())
                    for name in names
                ):
                    break
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"topics {', '.join(names)} were created, but broker {broker.id} does "
                        f"not list them after {TIMEOUT:.0f}s"
                    )
                time.sleep(0.2)

    def describe(self, names: list[str]) -> dict[str, TopicState | None]:
        """Each topic as the cluster has it; None for a topic that does not exist."""
        metadata = self._metadata()
        states: dict[str, TopicState | None] = {}
        for name in names:
            topic = metadata.topics.get(name)
            if topic is None or (topic.error is not None and not topic.partitions):
                states[name] = None
                continue
            states[name] = _state(name, topic)
        configs = self._configs([name for name, state in states.items() if state is not None])
        for name, entries in configs.items():
            state = states[name]
            assert state is not None
            if entries is None:  # deleted since the metadata above
                states[name] = None
                continue
            state.min_insync_replicas = _int(entries, "min.insync.replicas")
            state.retention_ms = _int(entries, "retention.ms")
            state.max_message_bytes = _int(entries, "max.message.bytes")
            if state.min_insync_replicas is not None:
                state.below_min_insync = [
                    p
                    for p, isr in _isr_sizes(metadata.topics[name]).items()
                    if isr < state.min_insync_replicas
                ]
        return states

    def _configs(self, names: list[str]) -> dict[str, Any]:
        """Each topic's settings; None for one that is gone. A broker that has not yet applied
        a topic just created answers "unknown topic" for a moment while metadata lists it:
        that is asked again until :data:`TIMEOUT`."""
        configs: dict[str, Any] = {}
        pending = list(names)
        deadline = time.monotonic() + TIMEOUT
        while pending:
            resources = [ConfigResource("topic", name) for name in pending]
            unknown = []
            for resource, future in self.admin.describe_configs(
                resources, request_timeout=TIMEOUT
            ).items():
                try:
                    configs[resource.name] = future.result(TIMEOUT * 2)
                except KafkaException as exc:
                    if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                        raise ConfigError(
                            f"cannot read topic {resource.name}'s settings: {_reason(exc)}"
                        ) from exc
                    unknown.append(resource.name)
            if unknown and time.monotonic() > deadline:
                configs.update(dict.fromkeys(unknown))
                break
            pending = unknown
            if pending:
                time.sleep(0.2)
        return configs


def check(
    states: dict[str, TopicState | None], declared: dict[str, TopicSettings], brokers: int
) -> list[Finding]:
    """What is wrong (or risky) with each topic on a cluster of ``brokers`` brokers.
    ``declared`` holds the settings asked for on the command line or in a file (a topic of
    the table only is checked for health)."""
    findings = []
    recommended = min(DEFAULT_REPLICATION_FACTOR, brokers)
    for name, state in states.items():
        if state is None:
            findings.append(Finding(name, "missing", "no such topic: its messages go dead"))
            continue
        if state.offline:
            findings.append(
                Finding(name, "offline", f"partitions {_list(state.offline)} have no leader")
            )
        if state.below_min_insync:
            findings.append(
                Finding(
                    name,
                    "not writable",
                    f"partitions {_list(state.below_min_insync)} have fewer in-sync replicas "
                    f"than min.insync.replicas={state.min_insync_replicas}: writes are refused",
                )
            )
        if state.under_replicated:
            findings.append(
                Finding(
                    name,
                    "under-replicated",
                    f"partitions {_list(state.under_replicated)}: {state.fewest_in_sync} of "
                    f"{state.replication_factor} replicas in sync",
                )
            )
        wanted = declared.get(name)
        if (
            wanted
            and wanted.replication_factor
            and state.replication_factor < wanted.replication_factor
        ):
            findings.append(
                Finding(
                    name,
                    "too few replicas",
                    f"{state.replication_factor} replica(s), {wanted.replication_factor} declared",
                )
            )
        elif state.replication_factor < recommended:
            findings.append(
                Finding(
                    name,
                    None,
                    f"{state.replication_factor} replica(s) on a cluster of {brokers} brokers: "
                    "losing one broker can lose acknowledged messages",
                    warning=True,
                )
            )
        if wanted and wanted.partitions and state.partitions != wanted.partitions:
            findings.append(
                Finding(
                    name,
                    None,
                    f"{state.partitions} partitions, {wanted.partitions} declared (adding "
                    "partitions moves keys: see docs/topics.md)",
                    warning=True,
                )
            )
        if state.replication_factor > 1 and (state.min_insync_replicas or 1) < 2:
            findings.append(
                Finding(
                    name,
                    None,
                    "min.insync.replicas=1: acks=all may be acknowledged by the leader alone",
                    warning=True,
                )
            )
        if state.retention_ms is not None and 0 <= state.retention_ms < SHORTEST_SAFE_RETENTION_MS:
            findings.append(
                Finding(
                    name,
                    None,
                    f"retention.ms={state.retention_ms}: under two days, the nightly "
                    "reconciliation may find records gone and report them missing",
                    warning=True,
                )
            )
    return findings


def describe_line(state: TopicState) -> str:
    """One topic's settings and health, for ``describe`` and ``check``."""
    retention = "-" if state.retention_ms is None else _duration(state.retention_ms)
    health = "in sync"
    if state.offline:
        health = f"{len(state.offline)} partition(s) offline"
    elif state.under_replicated:
        health = f"{len(state.under_replicated)} partition(s) under-replicated"
    return (
        f"{state.partitions} partitions, {state.replication_factor} replicas ({health}), "
        f"min.insync.replicas {state.min_insync_replicas or '-'}, retention {retention}, "
        f"max.message.bytes {state.max_message_bytes or '-'}"
    )


def _summary(topic: TopicSettings) -> str:
    return (
        f"{topic.partitions} partitions, {topic.replication_factor} replicas, "
        f"min.insync.replicas {topic.min_insync_replicas}, retention {topic.retention}"
    )


def _state(name: str, topic: Any) -> TopicState:
    partitions = topic.partitions
    replicas = min((len(p.replicas) for p in partitions.values()), default=0)
    isr = _isr_sizes(topic)
    return TopicState(
        name=name,
        partitions=len(partitions),
        replication_factor=replicas,
        under_replicated=sorted(
            p for p, meta in partitions.items() if len(meta.isrs) < len(meta.replicas)
        ),
        offline=sorted(p for p, meta in partitions.items() if meta.leader < 0),
        fewest_in_sync=min(isr.values(), default=0),
    )


def _isr_sizes(topic: Any) -> dict[int, int]:
    return {p: len(meta.isrs) for p, meta in topic.partitions.items()}


def _int(entries: dict[str, Any], name: str) -> int | None:
    entry = entries.get(name)
    try:
        return int(entry.value) if entry is not None and entry.value is not None else None
    except ValueError:
        return None


def _duration(ms: int) -> str:
    if ms < 0:
        return "forever"
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0 and ms >= size:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def _list(partitions: list[int]) -> str:
    shown = ",".join(str(p) for p in partitions[:10])
    return shown + (f" (+{len(partitions) - 10} more)" if len(partitions) > 10 else "")


def _reason(exc: KafkaException) -> str:
    error = exc.args[0] if exc.args else None
    return error.str() if isinstance(error, KafkaError) else str(exc)
