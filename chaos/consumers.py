"""The consuming service's consumers: ``outbox consume`` processes in one group, started,
killed and restarted by index, and how far behind the topics' ends the group is.

The fleet reads a consumer's counters from its metrics just before it stops it (kill -9
included), so the run can report how many duplicates the inbox skipped, summed over every
consumer process the run started.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

from confluent_kafka import Consumer, KafkaException, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from outbox.chaos.fleet import ProcessFleet
from outbox.chaos.service import GROUP

TARGET = "outbox.chaos.service:inbox"

# Short timings, so that a consumer killed with -9 leaves the group (and its partitions move)
# within seconds, and a stalled network turns into a rebalance too.
CONSUMER_ARGS = (
    "--batch-size",
    "200",
    "--backoff-base",
    "0.2",
    "--backoff-max",
    "2",
    "-X",
    "session.timeout.ms=10000",
    "-X",
    "heartbeat.interval.ms=1000",
)

#: The inbox's counters the run reports, by their Prometheus sample names.
COUNTERS = {
    "outbox_inbox_processed_total": "processed",
    "outbox_inbox_duplicates_total": "duplicates_skipped",
}

TP = tuple[str, int]


class ConsumerFleet(ProcessFleet):
    """``count`` consumers of the service; each writes to ``<logs>/consumer-<i>.log``."""

    def __init__(self, count: int, database_url: str, bootstrap: str, logs: Path) -> None:
        args = ["consume", TARGET, *CONSUMER_ARGS]
        super().__init__("consumer", count, args, database_url, bootstrap, logs)
        #: The counters of consumer processes that have ended.
        self.counted: Counter[str] = Counter()
        self._last: list[Counter[str]] = [Counter() for _ in range(count)]

    def _before_stop(self, index: int) -> None:
        exposition = self.metrics(index)
        if exposition is not None:  # else (not serving yet, or hung) its counts go unknown
            self._last[index] = counters(exposition)

    def _after_stop(self, index: int) -> None:
        # A process that ended by itself loses what it counted after the last reading.
        self.counted += self._last[index]
        self._last[index] = Counter()


def counters(exposition: str) -> Counter[str]:
    """The inbox's counters in a Prometheus exposition, summed over their labels."""
    found: Counter[str] = Counter()
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in COUNTERS:
                found[COUNTERS[sample.name]] += int(sample.value)
    return found


def lagging(bootstrap: str, ends: Mapping[TP, int], timeout: float = 10.0) -> dict[TP, int]:
    """Partitions whose committed offset (the group's) is short of ``ends``, with how far.

    ``ends`` is, per partition, the offset after its last record. A partition the group has
    never committed for counts as entirely behind.
    """
    if not ends:
        return {}
    reader = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": GROUP,  # only asked for its offsets: it never joins the group
            "enable.auto.commit": False,
            "client.id": f"chaos-lag-{uuid.uuid4().hex[:6]}",
        }
    )
    try:
        committed = reader.committed([TopicPartition(t, p) for t, p in ends], timeout=timeout)
    except KafkaException:
        return dict(ends)  # the coordinator did not answer: ask again later
    finally:
        reader.close()
    behind = {}
    for tp in committed:
        end = ends[(tp.topic, tp.partition)]
        if tp.offset < end:
            behind[(tp.topic, tp.partition)] = end - max(tp.offset, 0)
    return behind


def wait_caught_up(
    bootstrap: str, ends: Mapping[TP, int], timeout: float, pause: Callable[[], None]
) -> dict[TP, int]:
    """Ask :func:`lagging` until no partition is behind or ``timeout`` seconds have passed,
    calling ``pause`` in between; returns what is still behind."""
    deadline = time.monotonic() + timeout
    behind = lagging(bootstrap, ends)
    while behind and time.monotonic() < deadline:
        pause()
        behind = lagging(bootstrap, ends)
    return behind
