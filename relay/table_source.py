"""The outbox table as the relay's source of messages: reads, due scheduled rows, waking.

It keeps one session of its own, the *reading session*: the batch reads run on it, the due
scheduled rows of the owned shards are made pending on it before a read
(:mod:`outbox.relay.promotion`), and on it the relay LISTENs and keeps the wake lock's
handshake with the writers (:mod:`outbox.relay.wakeup`). Every read starts with a try of the
lock the owner session holds (the ``owner_alive`` query): once that session is gone, with the
shards' locks, nothing is read. A thread of its own refreshes the gauges every
:data:`GAUGE_SECONDS`, on a session of its own.

What a source keeps, since the relay's guarantees stand on it (the WAL source keeps them too):

- **Order.** A read returns, for each shard asked, the next messages that may go now, each
  key's in its order; a key whose earliest unsent message cannot go yet (backing off, held by
  an immediate sender) is held back from that message on.
- **Once.** A message read is read again (by this relay or the shard's next owner) until its
  outcome is recorded, and never after.
- **Ownership.** Nothing is read once the owner session is gone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import psycopg

from outbox.relay.commands import Read
from outbox.relay.config import RelayConfig
from outbox.relay.connections import open_session
from outbox.relay.observability import RelayMetrics
from outbox.relay.promotion import ScheduledPromotion
from outbox.relay.store import RelayStore
from outbox.relay.wakeup import WORKING_PAUSE, WakeUp
from outbox.rows import PendingRow

log = logging.getLogger("outbox.relay")

#: Seconds between refreshes of the gauges (the oldest pending message, scheduled ones).
GAUGE_SECONDS = 5.0


class TableSource:
    """The outbox table, read for one relay on its reading session."""

    def __init__(self, config: RelayConfig, store: RelayStore, metrics: RelayMetrics) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.promotion = ScheduledPromotion(config.spec, metrics, limit=config.batch_size)
        self.conn: psycopg.Connection | None = None
        self.owner_key = 0
        self._wake: WakeUp | None = None
        #: Shards read since the session opened: a shard's first read frees what relays of
        #: earlier versions left leased.
        self._seen: set[int] = set()
        self._owned: tuple[int, ...] = ()
        #: The last look before sleeping found leased rows of the owned shards.
        self._leases_seen = False
        self._gauges_stop = threading.Event()
        self._gauges: threading.Thread | None = None

    def connect(self, owner_key: int, name: str) -> None:
        """Open the reading session, beside the owner session that locked ``owner_key``."""
        conn = open_session(self.config, f"{name}/read", reading=True)
        try:
            if not self.store.owner_alive(conn, owner_key):
                # Another server behind the same address, say: it would read nothing, ever.
                raise psycopg.OperationalError(
                    "a relay session does not see its owner session's lock: are they on the"
                    " same server and database?"
                )
            conn.execute(f'LISTEN "{self.config.spec.notify_channel}"')
        except BaseException:
            conn.close()
            raise
        self.conn, self.owner_key = conn, owner_key
        self._wake = WakeUp(conn, self.config.spec)
        self._seen = set()
        if self._gauges is None:
            self._gauges = threading.Thread(
                target=self._refresh_gauges, name="outbox-gauges", daemon=True
            )
            self._gauges.start()

    @property
    def connected(self) -> bool:
        return self.conn is not None and not self.conn.closed

    @property
    def asleep(self) -> bool:
        """Whether the relay sleeps holding the wake lock (writers notify)."""
        return self._wake is not None and self._wake.asleep

    def read(self, read: Read, owned: Sequence[int]) -> list[PendingRow]:
        """The next rows of ``read.shards``; first the due scheduled rows of the ``owned``
        shards are made pending (at most every RELOOK_SECONDS)."""
        assert self.conn is not None
        self._owned = tuple(owned)
        new = [shard for shard in read.shards if shard not in self._seen]
        if new:
            try:
                self.store.break_leases(new, self.conn)
            except psycopg.errors.LockNotAvailable:
                pass  # tried again at the next read of these shards
            else:
                self._seen.update(new)
        self.promotion.promote(owned, self.conn, self.owner_key)
        return self.store.read_batch(
            read.shards, read.size, self.conn, read.per_shard, self.owner_key
        )

    def busy(self) -> None:
        """Work was found: no relay sleeps while this one works (writers do not notify)."""
        if self._wake is not None:
            self._wake.busy()

    def away(self) -> None:
        """This relay can serve no commit (it owns no shard): it watches for none."""
        if self._wake is not None and self.connected:
            self._wake.away()

    def sleep(self, timeout: float) -> bool:
        """Nothing to do: sleep watched, up to ``timeout`` (cut to the next due scheduled
        message, and to :data:`~outbox.relay.wakeup.WORKING_PAUSE` while an immediate sender
        holds rows of the owned shards, and once more when those leases are gone). Returns
        whether to look again at once (woken)."""
        assert self._wake is not None and self.conn is not None
        # A look due that no read makes (every shard was found empty lately): made here, so
        # that the relay does not spin until a read would make it.
        waiting = self.promotion.look_waiting() and self._owned
        if waiting and self.promotion.promote(self._owned, self.conn, self.owner_key):
            return True
        timeout = self.promotion.sleep_bound(timeout)
        # The immediate sender's mark wakes nobody: look as often as while another relay works.
        if timeout > WORKING_PAUSE:
            held = self.store.leases_held(self._owned, self.conn)
            if self._leases_seen and not held:
                # The leases seen before are gone (marked, given back), maybe since the last
                # read, and their marks woke nobody: the rows behind them may go now.
                self._leases_seen = False
                return True
            self._leases_seen = held
            if held:
                timeout = WORKING_PAUSE
        return self._wake.idle(timeout)

    def forget(self) -> None:
        """The session is gone (or going), its locks with it."""
        if self._wake is not None:
            self._wake.forget()
        if self.conn is not None:
            self.conn.close()
        self.conn, self._wake, self.owner_key = None, None, 0

    def close(self) -> None:
        self.forget()
        self._gauges_stop.set()
        if self._gauges is not None:
            self._gauges.join(10)
        self.store.close()

    def _refresh_gauges(self) -> None:
        """Count the oldest pending message's age and the scheduled ones into the gauges,
        every GAUGE_SECONDS, on a session of its own (a count can take a tenth of a second)."""
        session: psycopg.Connection | None = None
        while not self._gauges_stop.wait(GAUGE_SECONDS):
            try:
                if session is None or session.closed:
                    session = open_session(self.config, f"{self.store.name}/gauges")
                self.metrics.oldest_pending.set(self.store.oldest_pending_age(session))
                self.promotion.refresh_gauges(session)
            except psycopg.Error as error:
                log.debug("gauges not refreshed: %s", error)
                if session is not None:
                    session.close()
                session = None
        if session is not None:
            session.close()
