"""How far behind its topics a consumer group is: Kafka's committed offsets of the group
against the partitions' last stable offsets (what a ``read_committed`` consumer can read up
to), read with Kafka's admin API.

A running consumer reports its own lag as a metric (``outbox_inbox_lag``); this is the view
from outside, for the dashboard: it needs no consumer running and sees a group that stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, IsolationLevel, KafkaException
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

#: Seconds each admin request may take.
TIMEOUT = 10.0


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    committed: int
    #: The partition's last stable offset (its end, for a reader of committed records).
    end: int

    @property
    def lag(self) -> int:
        return max(self.end - self.committed, 0)


@dataclass
class GroupLag:
    """One group's committed partitions, or why they could not be read."""

    group: str
    partitions: list[PartitionLag] = field(default_factory=list)
    error: str | None = None

    @property
    def total(self) -> int | None:
        """Records committed to its topics that the group has not read past, over every
        partition it committed an offset for; None when that could not be read."""
        return None if self.error else sum(p.lag for p in self.partitions)


def read_lag(kafka: dict[str, Any], groups: list[str], timeout: float = TIMEOUT) -> list[GroupLag]:
    """The lag of each of ``groups`` (``kafka``: the admin client's settings, with
    ``bootstrap.servers``). A group Kafka cannot answer for carries the error instead."""
    admin = AdminClient({"log_level": 0, **kafka})
    found: list[GroupLag] = []
    committed: dict[tuple[str, str, int], int] = {}
    try:
        listing = admin.list_consumer_groups(request_timeout=timeout).result(timeout)
        known = {g.group_id for g in listing.valid}
    except KafkaException as exc:
        return [GroupLag(group, error=_reason(exc)) for group in groups]
    for group in groups:
        lag = GroupLag(group)
        found.append(lag)
        if group not in known:
            # Kafka knows no such group: it committed nothing. (Asked for its offsets,
            # librdkafka may crash the process: confluentinc/librdkafka#5040.)
            continue
        try:
            request = [ConsumerGroupTopicPartitions(group)]
            futures = admin.list_consumer_group_offsets(request, request_timeout=timeout)
            answer = futures[group].result(timeout)
        except KafkaException as exc:
            lag.error = _reason(exc)
            continue
        for tp in answer.topic_partitions or []:
            if tp.error is None and tp.offset >= 0:
                committed[(group, tp.topic, tp.partition)] = tp.offset
    wanted = {(topic, partition) for (_, topic, partition) in committed}
    ends = _ends(admin, wanted, timeout) if wanted else {}
    for lag in found:
        for (group, topic, partition), offset in sorted(committed.items()):
            if group != lag.group:
                continue
            end = ends.get((topic, partition))
            if isinstance(end, str):
                lag.error = end
            elif end is not None:
                lag.partitions.append(PartitionLag(topic, partition, offset, end))
    return found


def _ends(admin: AdminClient, wanted: set[tuple[str, int]], timeout: float) -> dict[Any, Any]:
    """Each partition's last stable offset, or the error text in its place."""
    from confluent_kafka import TopicPartition

    latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
    request = {TopicPartition(t, p): latest for t, p in sorted(wanted)}
    ends: dict[Any, Any] = {}
    try:
        futures = admin.list_offsets(
            request, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=timeout
        )
    except KafkaException as exc:
        return {tp: _reason(exc) for tp in wanted}
    for tp, future in futures.items():
        try:
            ends[(tp.topic, tp.partition)] = future.result(timeout).offset
        except KafkaException as exc:
            ends[(tp.topic, tp.partition)] = _reason(exc)
    return ends


def _reason(exc: KafkaException) -> str:
    error = exc.args[0] if exc.args else exc
    return str(getattr(error, "str", lambda: error)())
