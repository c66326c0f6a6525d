"""When an idle relay sleeps, for how long, and whether it watches for writers.

Invariant: a relay that sleeps watched (it holds the wake lock, so writers notify) owns shards
and has not stepped aside; one that owns none holds no wake lock (``WakeUp.away``), since
writers would otherwise notify at every commit while the others work. A relay sleeps only when
its last step found no work (nothing read, in flight or being recorded), never past its next
rebalance, its poll interval or the next due scheduled message of its shards
(:mod:`outbox.relay.promotion`), and no longer than :data:`HELD_RELOOK_SECONDS` while an
immediate sender holds rows of its shards: the sender's mark wakes nobody, and the later rows
of the held keys may go once it lands.

Assumes: :mod:`outbox.relay.wakeup`'s handshake wakes a watched relay for every commit made
while it sleeps; the loop looks again before sleeping after a batch was recorded (no commit is
left to wake it for rows that batch left behind).
"""

from __future__ import annotations

import time

import psycopg

from outbox.relay.state import RelayState

#: Longest sleep of an idle relay while an immediate sender holds rows of its shards: the
#: sender's mark wakes nobody, and the held keys' later rows may go once it lands.
HELD_RELOOK_SECONDS = 0.05


class Sleeping(RelayState):
    """Idling and the wake-up watch (a part of :class:`~outbox.relay.daemon.Relay`)."""

    def _give_up_watch(self) -> None:
        """A relay that cannot publish must not watch for the others (they would only poll)."""
        if self._wake is None or self._conn is None or self._conn.closed:
            return
        try:
            self._wake.away()
        except psycopg.Error as error:
            # Closed with the connection, the locks cannot outlive what this relay knows.
            self._lost_database(error)

    def _owns_shards(self) -> bool:
        return self._ownership is not None and bool(self._ownership.owned)

    def _sleep_timeout(self) -> float:
        """How long an idle relay may sleep: until the poll interval or the next rebalance."""
        return min(self.config.poll_interval, max(0.0, self._next_rebalance - time.monotonic()))

    def _idle_timeout(self) -> float:
        """How long an idle relay that owns shards may sleep: while an immediate sender holds
        rows of them, a short while only. Its mark, an UPDATE, wakes nobody, and the later
        rows of the held keys (given back, or written without immediate send) may go then.
        It sleeps no longer than until the next scheduled message of its shards is due."""
        timeout = self.store.sleep_bound(self._sleep_timeout())
        assert self._ownership is not None and self._reader is not None
        if timeout > HELD_RELOOK_SECONDS and self.store.leases_held(
            sorted(self._ownership.owned), self._reader
        ):
            return HELD_RELOOK_SECONDS
        return timeout
