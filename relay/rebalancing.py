"""Rebalancing: joining the members, letting shards go, and taking gained shards over.

Invariant: a shard changes hands only with no batch of it in flight or being recorded. Before
shards are let go the loop drains (every batch in flight ends and is recorded), and shards
whose outcome still waits for another transaction's row lock are kept (``keep``). A gained
shard is owned (locked) at once but read only once its take-over ended: exactly-once, its
earlier owner fenced and the rows its last committed transactions held marked sent; in either
mode, the immediate sender's leases on it taken back (:mod:`outbox.relay.takeover`). A
take-over that failed gives its shards back, for a later rebalance to try again.

Assumes: :mod:`outbox.relay.ownership` holds the locks on the owner session and settles who
owns what; :mod:`outbox.relay.serving` says whether Kafka is in reach before any shard is taken
and decides about stepping aside; :mod:`outbox.relay.reading` reads no shard being taken over.
"""

from __future__ import annotations

import functools
import logging
import time

from confluent_kafka import KafkaException

from outbox.relay.observability import mask_secrets
from outbox.relay.serving import KAFKA_PROBE_TIMEOUT, UNREACHABLE_BEFORE_STEPPING_ASIDE
from outbox.relay.state import RelayState

log = logging.getLogger("outbox.relay")

#: Seconds between refreshes of the oldest-pending gauge.
GAUGE_INTERVAL = 5.0


class Rebalancing(RelayState):
    """Rebalancing and take-overs (a part of :class:`~outbox.relay.daemon.Relay`)."""

    def _maybe_rebalance(self) -> None:
        now = time.monotonic()
        if now < self._next_rebalance:
            return
        assert self._ownership is not None and self._publisher is not None
        self._next_rebalance = now + self.config.rebalance_interval
        # Marks run on sessions of their own, and the shards let go below are drained first
        # (_drain): what is recorded by now is finished, nothing is waited for.
        self._collect_recordings(block=False)
        self._publisher.serve_events()
        self._finish_take_overs()
        if not self._ownership.joined and self._stays_aside(now):
            return  # stepped aside: the others serve its share meanwhile
        if not self._ownership.joined:
            # A relay that cannot publish must not count as a member: each member lowers the
            # others' share, and the shards they let go would wait for it.
            self._publisher.check_reachable(KAFKA_PROBE_TIMEOUT)
            self.health.kafka_ok = True
            self._last_reached = time.monotonic()
            self._ownership.join()
            self.health.stepped_aside = False
        self._refresh_serving(now)
        # A shard changes hands only with no batch of it in flight: the batches in flight
        # finish first when shards are to be let go (gained shards have none).
        gained, lost = self._ownership.rebalance(
            can_serve=self._kafka_reachable,
            before_letting_go=functools.partial(self._drain, wait_for_held=False),
            keep=self._held_shards,
        )
        if self._wake is not None:
            self._wake.alone = self._ownership.member_count <= 1
        if lost:
            self._publisher.let_go(lost)
            log.info("released shards %s", lost)
        if gained:
            self._take_over(gained)
        if (
            self._unreachable_since is not None
            and self._unreachable_since > self._last_reached  # nothing got through since
            and now - self._unreachable_since >= UNREACHABLE_BEFORE_STEPPING_ASIDE
        ):
            self._unreachable_since = None
            self._try_stepping_aside("Kafka stays out of its reach")
        self.metrics.owned_shards.set(len(self._ownership.owned))
        if now >= self._next_gauge:
            self._next_gauge = now + GAUGE_INTERVAL
            self.metrics.oldest_pending.set(self.store.oldest_pending_age())
            self.store.refresh_gauges()

    def _take_over(self, shards: list[int]) -> None:
        """Start taking ``shards`` over in the background (see :mod:`outbox.relay.takeover`):
        fence their earlier owner, mark sent what its last committed transactions held."""
        publisher, store = self._publisher, self.store
        assert publisher is not None

        def take_over() -> tuple[int, int]:
            recovered = publisher.take_over(shards)
            return store.mark_committed(recovered), store.break_leases(shards)

        log.info("taking over shards %s", shards)
        self._take_overs.start(shards, take_over)

    def _finish_take_overs(self, wait_for_all: bool = False) -> None:
        """Put the shards of the take-overs that ended to work, or give them back."""
        assert self._publisher is not None and self._ownership is not None
        for take_over in self._take_overs.ended(wait_for_all):
            shards = list(take_over.shards)
            error = take_over.error()
            if error is None and set(shards) <= self._ownership.owned:
                marked, broken = take_over.future.result()
                self._failed_take_overs = self.step_asides = 0
                self._rejoin_at = 0.0
                self._last_reached = time.monotonic()
                self._ownership.mark_serving()
                log.info(
                    "took over shards %s (%d rows marked sent from committed progress, "
                    "%d leases taken back)",
                    shards,
                    marked,
                    broken,
                )
                continue
            # Owning a shard that was not taken over properly would stall it: give the shards
            # back, so that a later rebalance (here or in another relay) tries again.
            self._publisher.let_go(shards)
            self._ownership.release(shards)
            if error is None:
                continue  # let go meanwhile (a step aside)
            if not isinstance(error, KafkaException | TimeoutError):
                raise error  # the database: the loop reconnects
            # TimeoutError: Kafka did not answer in time (progress reads).
            log.error("taking over shards %s failed: %s", shards, mask_secrets(str(error)))
            self.health.kafka_ok = False
            if wait_for_all:
                # Draining before shards change hands: no stepping aside in the middle of it.
                self._ownership.mark_failing()
            else:
                self._take_over_failed()
