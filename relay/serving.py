"""Whether this relay serves (reaches Kafka), and stepping aside when it cannot.

Invariant: a relay steps aside only while another member serves (decided under one lock all
relays share, :meth:`~outbox.relay.ownership.ShardOwnership.step_aside`), only with nothing
of its shards in flight, and not while it holds outcomes: a relay whose marks wait for another
transaction's row lock keeps its shards until they are recorded. It takes no shard while a
probe says Kafka is out of its reach. Its serving lock says whether it reaches Kafka, and stays
true while it idles: exactly-once, batches that Kafka leaves unanswered for
:data:`UNANSWERED_SECONDS` mark it failing, and an idle member asks a broker every
:data:`SERVING_REFRESH_SECONDS`.

A relay steps aside after :data:`FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE` failed take-overs
in a row, or when its probe has failed for :data:`UNREACHABLE_BEFORE_STEPPING_ASIDE` seconds
while it lacks shards of its share; it stays out for :data:`STEP_ASIDE_SECONDS`, doubled at
each step aside in a row, unless its share has nobody to send it.

Assumes: :mod:`outbox.relay.marking` records everything in flight on a drain and names the
shards whose outcome still waits (``_held_shards``), and marks the relay serving on an
acknowledged batch and failing on a lost producer or a retriable failure;
:mod:`outbox.relay.rebalancing` calls these checks once per rebalance.
"""

from __future__ import annotations

import logging
import time

import psycopg
from confluent_kafka import KafkaException

from outbox.relay.state import RelayState

log = logging.getLogger("outbox.relay")

#: Seconds a broker has to answer the metadata request that shows Kafka is in reach.
KAFKA_PROBE_TIMEOUT = 5.0
#: A relay whose batch was acknowledged this many seconds ago or less is in Kafka's reach:
#: it takes shards (a dead relay's, say) without probing first.
RECENT_ACK_SECONDS = 2.0
#: Take-overs that fail in a row before a relay tries to step aside (leave the members), so
#: that healthy relays take its share instead of the shards waiting for it to recover.
FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE = 2
#: Seconds out of the members the first time; doubled at each step aside in a row, up to
#: the longest. A take-over that works resets both counts.
STEP_ASIDE_SECONDS = 10.0
LONGEST_STEP_ASIDE_SECONDS = 160.0
#: An exactly-once member that has not shown for this long that it reaches Kafka (an
#: acknowledged batch, a take-over, a probe) asks a broker at its next rebalance, when idle:
#: whether it serves must stay true while it idles.
SERVING_REFRESH_SECONDS = 5.0
#: Batches in flight this long with nothing acknowledged: the relay does not serve.
UNANSWERED_SECONDS = 15.0
#: A failed take-over this recent keeps an idle relay's probe from making it serve again;
#: one older than the longest is forgotten when the next one fails.
RECENT_FAILURE_SECONDS = 15.0
FAILED_TAKE_OVERS_FORGOTTEN_SECONDS = 300.0
#: Seconds a relay that stepped aside waits, when members are left but none serves, before
#: it joins again (a blip that turned one batch back is no reason to come back).
NOBODY_SERVING_GRACE = 5.0
#: Seconds a member's probe must keep failing, while it lacks shards of its share, before it
#: steps aside like a relay whose take-overs fail: it takes none while Kafka is out of its
#: reach, and as a member it keeps the others from taking them.
UNREACHABLE_BEFORE_STEPPING_ASIDE = 10.0


class Serving(RelayState):
    """Serving and stepping aside (a part of :class:`~outbox.relay.daemon.Relay`)."""

    def _kafka_reachable(self) -> bool:
        """Probe Kafka before taking shards: a relay out of its reach takes none."""
        assert self._publisher is not None
        if time.monotonic() - self._last_ack <= RECENT_ACK_SECONDS:
            return True  # a batch just got through: no probe to delay the take-over
        try:
            self._publisher.check_reachable(KAFKA_PROBE_TIMEOUT)
        except KafkaException as error:
            log.warning("Kafka out of reach (%s); taking no shards", error.args[0])
            self.health.kafka_ok = False
            self._ownership.mark_failing()  # type: ignore[union-attr]
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
            return False
        self._unreachable_since = None
        self.health.kafka_ok = True
        self._last_reached = time.monotonic()
        return True

    def _take_over_failed(self) -> None:
        """Count a take-over that Kafka failed; after a few in a row, step aside if another
        member serves (ShardOwnership.step_aside): this relay's path to Kafka, not Kafka, may
        be what is broken, and its share would otherwise wait for it."""
        assert self._ownership is not None and self._publisher is not None
        self._ownership.mark_failing()
        now = time.monotonic()
        if now - self._last_failed_take_over > FAILED_TAKE_OVERS_FORGOTTEN_SECONDS:
            self._failed_take_overs = 0
        self._last_failed_take_over = now
        self._failed_take_overs += 1
        if self._failed_take_overs >= FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE:
            self._try_stepping_aside("shard take-overs keep failing")

    def _try_stepping_aside(self, why: str) -> None:
        """Step aside if another member serves; else stay and keep trying here."""
        assert self._ownership is not None and self._publisher is not None
        if self._ownership.others_serving() == 0:
            return
        self._drain(wait_for_held=False)  # nothing of a shard may be in flight when it goes
        if self._held_shards():
            return  # an outcome waits for a row lock: stay until it is recorded
        released = self._ownership.step_aside()
        if released is None:
            return  # nobody else serves: keep trying here
        self._publisher.let_go(released)
        pause = min(LONGEST_STEP_ASIDE_SECONDS, STEP_ASIDE_SECONDS * 2**self.step_asides)
        self.step_asides += 1
        # Back in, one more failed take-over sends it aside again: each return costs the
        # healthy relays a hand-over and leaves its share unsent while the take-over fails.
        self._failed_take_overs = FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE - 1
        self._nobody_serving_since = None
        self._rejoin_at = time.monotonic() + pause
        self.health.stepped_aside = True
        self.health.batch_done(progressed=True)  # owning nothing, it has nothing to be stuck on
        self.metrics.owned_shards.set(0)
        log.warning(
            "%s: stepping aside for up to %.0fs (released shards %s) so that the other relays "
            "take them",
            why,
            pause,
            released,
        )

    def _stays_aside(self, now: float) -> bool:
        """A relay that stepped aside stays out until its pause ends, unless its share has
        nobody to send it: no member left (at once), or none serving for a few seconds."""
        assert self._ownership is not None
        if now >= self._rejoin_at:
            return False
        if self._ownership.others_serving() > 0:
            self._nobody_serving_since = None
            return True
        if self._ownership.other_members() == 0:
            return False
        if self._nobody_serving_since is None:
            self._nobody_serving_since = now
        return now - self._nobody_serving_since < NOBODY_SERVING_GRACE

    def _refresh_serving(self, now: float) -> None:
        """Keep the serving lock true when nothing has said for a while whether this relay
        reaches Kafka: batches in flight that Kafka does not answer mean it does not; an
        idle relay asks a broker."""
        assert self._ownership is not None and self._publisher is not None
        if not self.config.exactly_once:
            # Its take-overs ask nothing of Kafka, so unanswered batches do not count here;
            # a Kafka check that keeps failing still makes it step aside (rebalancing).
            return
        if self._busy_shards:
            oldest = min(began for _, began, _ in self._busy_shards.values())
            if now - max(oldest, self._last_ack) > UNANSWERED_SECONDS:
                self._ownership.mark_failing()
            return
        if now - max(self._last_reached, self._probed_at) <= SERVING_REFRESH_SECONDS:
            return
        self._probed_at = now
        try:
            self._publisher.check_reachable(KAFKA_PROBE_TIMEOUT)
        except KafkaException:
            self._ownership.mark_failing()
            return
        self._last_reached = now
        if now - self._last_failed_take_over > RECENT_FAILURE_SECONDS:
            self._ownership.mark_serving()

    def _not_serving(self) -> None:
        """Kafka failed this relay: no other relay steps aside on its account."""
        if self._ownership is None or self._conn is None or self._conn.closed:
            return
        try:
            self._ownership.mark_failing()
        except psycopg.Error as error:
            self._lost_database(error)
