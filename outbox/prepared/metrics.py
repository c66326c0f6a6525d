"""The check-back runner's Prometheus metrics and health, served by the shared
:mod:`outbox.health_server` (``/metrics``, ``/healthz``, ``/readyz``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from outbox.loops import LoopHealth
from outbox.outages import DATABASE_OUTAGE_LIMIT, DatabaseOutage


class CheckbackMetrics:
    """The runner's metrics, on a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.prepared = Gauge(
            "outbox_checkback_prepared",
            "Prepared messages waiting for a verdict, per check group",
            ["group"],
            registry=r,
        )
        self.oldest = Gauge(
            "outbox_checkback_oldest_prepared_seconds",
            "Age of the oldest prepared message, per check group",
            ["group"],
            registry=r,
        )
        self.checks = Counter(
            "outbox_checkback_checks",
            "Checks made, by answer: commit, rollback, unknown, error, timeout",
            ["group", "answer"],
            registry=r,
        )
        self.resolved = Counter(
            "outbox_checkback_resolved",
            "Prepared messages committed or rolled back by a check's answer",
            ["group", "answer"],
            registry=r,
        )
        self.expired = Counter(
            "outbox_checkback_expired",
            "Prepared messages given up on after max checks, by how they ended "
            "(rolled_back or dead)",
            ["group", "end"],
            registry=r,
        )
        self.check_seconds = Histogram(
            "outbox_checkback_check_seconds",
            "Time a checker took to answer",
            ["group"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.hung = Gauge(
            "outbox_checkback_hung_checks",
            "Checker calls past their timeout that have not returned",
            registry=r,
        )
        self.paused = Gauge(
            "outbox_checkback_paused",
            "1 while a check group is not checked because max hung checks of it are hung",
            ["group"],
            registry=r,
        )
        self.skipped = Counter(
            "outbox_checkback_skipped_rounds",
            "Rounds that left a check group out because max hung checks of it are hung",
            ["group"],
            registry=r,
        )


class CheckbackHealth(DatabaseOutage, LoopHealth):
    """What the health endpoints report; the runner updates it. Not alive either when
    ``max_hung`` checker calls have timed out and still not returned, or when the database
    has been out of reach for ``database_outage_limit`` seconds."""

    def __init__(
        self,
        stale_after: float,
        max_hung: int,
        database_outage_limit: float = DATABASE_OUTAGE_LIMIT,
    ) -> None:
        super().__init__(stale_after)
        self.max_hung = max_hung
        self.hung = 0
        self.database_outage_limit = database_outage_limit

    def alive_problems(self) -> list[str]:
        hung = [f"{self.hung} checks hung"] if self.hung >= self.max_hung else []
        return super().alive_problems() + hung + self.database_outage_problems()
