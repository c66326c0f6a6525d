"""Prometheus metrics and the health endpoints (the logs: :mod:`outbox.logs`)."""

from __future__ import annotations

import time
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
    relay with one shard wedged while the others go on: a batch (sent or being marked) or a
    take-over that has not ended after ``stale_after`` seconds.
    """

    def __init__(self, stale_after: float) -> None:
        self.stale_after = stale_after
        self.last_tick = time.monotonic()
        self.stuck_since: float | None = None
        self.database_ok = False
        self.kafka_ok = False
        self.stopping = False
        #: Out of the members for a while after its take-overs kept failing.
        self.stepped_aside = False
        #: When the oldest batch or take-over still unfinished began (None: nothing runs).
        self.oldest_unfinished: float | None = None

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

    def working_since(self, began: float | None) -> None:
        """Record when the oldest batch or take-over still unfinished began."""
        self.oldest_unfinished = began

    @property
    def wedged(self) -> bool:
        """A batch or take-over of one of its shards has not ended for ``stale_after``."""
        began = self.oldest_unfinished
        return began is not None and time.monotonic() - began >= self.stale_after

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
                ("stepped aside: its shard take-overs kept failing", self.stepped_aside),
            )
            if bad
        ]
        return ", ".join(reasons)


def serve(host: str, port: int, metrics: RelayMetrics, health: HealthState) -> ThreadingHTTPServer:
    """Serve /metrics, /healthz (the loop is turning) and /readyz (and connected)."""
    return health_server.serve(host, port, metrics.registry, health, "outbox-metrics")
