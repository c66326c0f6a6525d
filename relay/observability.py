"""Prometheus metrics and the health endpoints (the logs: :mod:`outbox.logs`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from outbox import health_server

# Re-exported: the relay masks secrets with the library's one implementation.
from outbox.redaction import mask_secrets as mask_secrets


class RelayMetrics:
    """The relay's Prometheus metrics, on a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.published = Counter(
            "outbox_relay_published", "Messages acknowledged by Kafka", ["topic"], registry=r
        )
        self.retried = Counter(
            "outbox_relay_retried", "Failed attempts scheduled for retry", ["topic"], registry=r
        )
        self.dead = Counter(
            "outbox_relay_dead", "Messages moved to the dead state", ["topic", "reason"], registry=r
        )
        self.batch_size = Histogram(
            "outbox_relay_batch_size",
            "Messages per leased batch",
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000),
            registry=r,
        )
        self.batch_seconds = Histogram(
            "outbox_relay_batch_seconds",
            "Time to lease, publish and record one batch",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.commit_to_ack = Histogram(
            "outbox_relay_commit_to_ack_seconds",
            "From the writing transaction to Kafka's acknowledgement",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 120, 600),
            registry=r,
        )
        self.oldest_pending = Gauge(
            "outbox_relay_oldest_pending_seconds", "Age of the oldest pending message", registry=r
        )
        self.owned_shards = Gauge("outbox_relay_owned_shards", "Shards this relay owns", registry=r)
        self.marks_blocked = Counter(
            "outbox_relay_marks_blocked",
            "Marks that stopped waiting for a row lock another transaction holds (the rows'"
            " shards wait until the lock goes)",
            registry=r,
        )
        self.scheduled = Gauge(
            "outbox_relay_scheduled",
            "Scheduled messages waiting in the table (counted every 5 s)",
            registry=r,
        )
        self.scheduled_overdue = Gauge(
            "outbox_relay_scheduled_overdue",
            "Scheduled messages due more than a second ago and not pending yet",
            registry=r,
        )
        self.promoted = Counter(
            "outbox_relay_promoted",
            "Scheduled messages this relay made pending when they were due",
            registry=r,
        )
        self.batches_failed = Counter(
            "outbox_relay_batches_failed",
            "Batches that failed as a whole, nothing of them acknowledged (a transaction refused"
            " or aborted, a producer lost); their messages are sent again",
            registry=r,
        )
        self.order_gaps = Counter(
            "outbox_relay_order_gaps",
            "Messages acknowledged after an earlier message of their key failed (never expected)",
            registry=r,
        )


class HealthState:
    """What the health endpoints report; the relay loop updates it.

    Alive means the loop turns *and* gets somewhere: a relay whose batches keep coming back
    unsent (none acknowledged, none failed) for ``stale_after`` seconds holds its shards for
    nothing, and a supervisor should restart it so that others take them over. So does a
    relay with one shard wedged while the others go on: a batch on its way to Kafka that has
    not ended after ``stale_after`` seconds (Kafka may take the delivery timeout), or a mark
    (what Kafka answered being recorded) or a take-over not ended after ``wedge_after`` seconds
    (a mark is one statement, and a take-over gives up after 60 s: longer means a lock or a
    hang, not work). ``wedge_after`` defaults to ``stale_after``.
    """

    def __init__(self, stale_after: float, wedge_after: float | None = None) -> None:
        self.stale_after = stale_after
        self.wedge_after = stale_after if wedge_after is None else wedge_after
        self.last_tick = time.monotonic()
        self.stuck_since: float | None = None
        self.database_ok = False
        self.kafka_ok = False
        self.stopping = False
        #: Out of the members for a while: Kafka did not answer it while another relay served.
        self.stepped_aside = False
        #: When the oldest batch or take-over still unfinished began (None: nothing runs).
        self.oldest_unfinished: float | None = None
        #: When the oldest mark or take-over still unfinished began (None: nothing runs).
        self.oldest_mark_or_take_over: float | None = None
        #: When the mark the loop itself waits for began (None: it waits for none).
        self.loop_marking_since: float | None = None

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def batch_done(self, progressed: bool) -> None:
        """Record whether a leased batch got anywhere (acknowledged or failed rows)."""
        if progressed:
            self.stuck_since = None
        elif self.stuck_since is None:
            self.stuck_since = time.monotonic()

    @property
    def stuck(self) -> bool:
        return (
            self.stuck_since is not None and time.monotonic() - self.stuck_since >= self.stale_after
        )

    def working_since(self, began: float | None, marking: float | None = None) -> None:
        """Record when the oldest batch or take-over still unfinished began, and (``marking``)
        the oldest mark or take-over."""
        self.oldest_unfinished = began
        self.oldest_mark_or_take_over = marking

    @contextmanager
    def marking(self) -> Iterator[None]:
        """A mark the loop itself makes (failures, in a transaction): while it waits for a row
        lock the loop does not turn, and it wedges the relay as a background mark does."""
        self.loop_marking_since = time.monotonic()
        try:
            yield
        finally:
            self.loop_marking_since = None

    def _oldest_mark(self) -> float | None:
        started = (self.oldest_mark_or_take_over, self.loop_marking_since)
        return min((began for began in started if began is not None), default=None)

    @property
    def wedged(self) -> bool:
        """A batch of one of its shards has not ended for ``stale_after``, or a mark or
        take-over for ``wedge_after``."""
        now = time.monotonic()
        began, marking = self.oldest_unfinished, self._oldest_mark()
        return (began is not None and now - began >= self.stale_after) or (
            marking is not None and now - marking >= self.wedge_after
        )

    @property
    def alive(self) -> bool:
        return (
            time.monotonic() - self.last_tick < self.stale_after
            and not self.stuck
            and not self.wedged
        )

    @property
    def ready(self) -> bool:
        return (
            self.alive
            and self.database_ok
            and self.kafka_ok
            and not self.stopping
            and not self.stepped_aside
        )

    def not_alive_because(self) -> str:
        if self.stuck:
            return "stuck: batches are not sent"
        if self.wedged:
            marking = self._oldest_mark()
            if marking is not None and time.monotonic() - marking >= self.wedge_after:
                return (
                    f"wedged: a mark or take-over of its shards has not ended"
                    f" for {self.wedge_after:g}s"
                )
            return (
                f"wedged: a batch or take-over of its shards has not ended"
                f" for {self.stale_after:.0f}s"
            )
        return "stalled"

    def not_ready_because(self) -> str:
        reasons = [
            reason
            for reason, bad in (
                ("stopping", self.stopping),
                ("not alive", not self.alive),
                ("database out of reach", not self.database_ok),
                ("Kafka out of reach", not self.kafka_ok),
                ("stepped aside: Kafka did not answer it", self.stepped_aside),
            )
            if bad
        ]
        return ", ".join(reasons)


def serve(host: str, port: int, metrics: RelayMetrics, health: HealthState) -> ThreadingHTTPServer:
    """Serve /metrics, /healthz (the loop is turning) and /readyz (and connected)."""
    return health_server.serve(host, port, metrics.registry, health, "outbox-metrics")
