"""The consumer's Prometheus metrics and its health endpoints (the relay's pattern).

``/metrics`` (Prometheus), ``/healthz`` (the loop turns) and ``/readyz`` (and reaches the
database and Kafka) on one small HTTP server thread.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from outbox.loops import LoopHealth
from outbox.outages import DATABASE_OUTAGE_LIMIT, DatabaseOutage


class InboxMetrics:
    """The consumer's metrics, on a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.processed = Counter(
            "outbox_inbox_processed", "Messages applied (handler committed)", ["topic"], registry=r
        )
        self.duplicates = Counter(
            "outbox_inbox_duplicates",
            "Records skipped because their message id was applied already (its inbox row "
            "exists, or a copy earlier in the batch was applied); a copy of a parked or "
            "retried message is parked or held back, never counted here",
            ["topic"],
            registry=r,
        )
        self.parked = Counter(
            "outbox_inbox_parked", "Messages parked", ["topic", "reason"], registry=r
        )
        self.retried = Counter(
            "outbox_inbox_handler_failures",
            "Handler failures (each is retried or, after the last attempt, parked)",
            ["topic"],
            registry=r,
        )
        self.handler_seconds = Histogram(
            "outbox_inbox_handler_seconds",
            "Time spent in handlers, per message",
            ["topic"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
            registry=r,
        )
        self.batch_handler_seconds = Histogram(
            "outbox_inbox_batch_handler_seconds",
            "Time spent in batch handlers, per call (one topic's messages of one batch)",
            ["topic"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
            registry=r,
        )
        self.batch_seconds = Histogram(
            "outbox_inbox_batch_seconds",
            "Time to apply and commit one batch",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.lag = Gauge(
            "outbox_inbox_lag",
            "Records behind the partition's end (high watermark - position)",
            ["topic", "partition"],
            registry=r,
        )
        self._handler_seconds: dict[str, Any] = {}
        self.assigned = Gauge(
            "outbox_inbox_assigned_partitions", "Partitions this consumer owns", registry=r
        )

    def observe_handler(self, topic: str, seconds: float) -> None:
        """One handler call (the labelled child is looked up once per topic: a hot path)."""
        child = self._handler_seconds.get(topic)
        if child is None:
            child = self._handler_seconds[topic] = self.handler_seconds.labels(topic)
        child.observe(seconds)

    def observe_batch_handler(self, topic: str, seconds: float) -> None:
        """One batch handler call."""
        self.batch_handler_seconds.labels(topic).observe(seconds)


#: Seconds a blocking call to Kafka (an offset commit) may take before Kafka counts as out
#: of reach: a synchronous commit waits as long as the group coordinator is down.
KAFKA_CALL_LIMIT = 5.0


class InboxHealth(DatabaseOutage, LoopHealth):
    """What the health endpoints report; the runner updates it. Ready also needs Kafka (once
    the consumer is subscribed; before that, and until the group gives it partitions, it
    says so rather than blame Kafka) and every subscribed topic to exist. Not alive when the
    database has been out of reach for ``database_outage_limit`` seconds."""

    def __init__(
        self, stale_after: float = 60.0, database_outage_limit: float = DATABASE_OUTAGE_LIMIT
    ) -> None:
        super().__init__(stale_after)
        self.database_outage_limit = database_outage_limit
        #: None until Kafka first answered (an assignment, an offset commit) or failed.
        self._kafka_ok: bool | None = None
        #: Set once the consumer subscribed (after the database answered).
        self.subscribed = False
        #: When the blocking Kafka call in progress began (None: none in progress).
        self.kafka_call_since: float | None = None
        #: Subscribed topics Kafka says do not exist (nothing is read from them).
        self.missing_topics: set[str] = set()

    @property
    def kafka_ok(self) -> bool:
        """Kafka answered last time, and no call to it has been blocking for long."""
        since = self.kafka_call_since
        return self._kafka_ok is True and (
            since is None or time.monotonic() - since < KAFKA_CALL_LIMIT
        )

    @kafka_ok.setter
    def kafka_ok(self, value: bool) -> None:
        self._kafka_ok = value

    def alive_problems(self) -> list[str]:
        return super().alive_problems() + self.database_outage_problems()

    def ready_problems(self) -> list[str]:
        problems = super().ready_problems()
        if not self.subscribed:
            return [*problems, "not subscribed yet"]
        problems += [f"topic {name} does not exist" for name in sorted(self.missing_topics)]
        if self.kafka_ok:
            return problems
        if self._kafka_ok is None and self.kafka_call_since is None:
            # A group that has nothing to give it (its only topics missing) is named above.
            return problems if self.missing_topics else [*problems, "joining the consumer group"]
        return [*problems, "Kafka out of reach"]
