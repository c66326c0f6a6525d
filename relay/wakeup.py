"""How an idle relay learns of new rows without making every writer pay for a NOTIFY.

A transaction that notifies takes a database-wide lock at commit, so writers that all
notify commit one at a time. Writers therefore notify only while a relay sleeps, and the
table's *wake lock* (an advisory lock, see ``OutboxTableSpec.wake_lock``) says when:

* A writer's insert trigger asks for the wake lock in shared mode and keeps it to commit.
  Refused (an idle relay holds it exclusively), the writer queues a NOTIFY instead.
* A relay whose last look found nothing takes the wake lock exclusively, without waiting.
  Granted, no writer that skipped the NOTIFY is still uncommitted, and every later one will
  notify; the relay then sends one NOTIFY itself, so that every relay (itself too) looks
  once more at what was committed before it held the lock, and sleeps. Refused, writers are
  mid-transaction: it looks again after a short, growing pause (the only polling).
* One relay holds the wake lock for all idle relays (the *sleeper* lock picks it); a NOTIFY
  reaches every listener. Others sleep until a NOTIFY or their poll interval, but only while
  the watcher sleeps: while it cannot (writers mid-transaction), they pause and look again
  as it does. The watching relay NOTIFYs again when it gets work and lets go, so the others
  never sleep unwatched.
* A busy relay holds the wake lock shared, as a writer does, for as long as it is busy: no
  relay sleeps while another works, so writers never notify then, however many relays idle
  beside it. The idle ones look again at the settle pauses meanwhile (at least every
  :data:`MAX_SETTLE_PAUSE`): a row of their shards waits that long at most, never their poll
  interval. A relay that gets work while the watcher sleeps is refused the shared hold: it
  NOTIFYs ``working`` (at most every :data:`WORKING_NOTICE_INTERVAL`), the watcher lets the
  wake lock go and leaves it alone for :data:`WORKING_GRACE`, and the busy relay takes its
  shared hold at its next turn.
* A relay that can serve no commit (it owns no shard, or stepped aside) holds nothing
  (:meth:`WakeUp.away`): were it to watch, every writer would notify while the others work.

Writers that find no relay asleep only take a shared lock, and never notify.
"""

from __future__ import annotations

import time

import psycopg

from outbox.schema import OutboxTableSpec

#: Pause, in seconds, before trying again to take the wake lock from writers; writers
#: usually commit within a few milliseconds, and rows they commit meanwhile wait this long.
SETTLE_PAUSE = 0.001
#: Tries at that pause before the pause doubles.
SHORT_SETTLE_TRIES = 10
#: Longest pause: a transaction left open after inserting, or another relay at work, keeps
#: an idle relay looking this often.
MAX_SETTLE_PAUSE = 0.05
#: Payload of the NOTIFY a relay that got work sends when the sleeping watcher refuses it
#: the shared hold, and the least time between two of them.
WORKING = "working"
WORKING_NOTICE_INTERVAL = 0.02
#: Seconds a watcher told that a relay works leaves the wake lock alone: longer than a busy
#: relay's turn (a wait for Kafka is cut into 0.2 s slices), so that the busy relay takes
#: its shared hold before the watcher could fall asleep again.
WORKING_GRACE = 0.5


class WakeUp:
    """The wake-up state of one relay, on its autocommit LISTEN connection."""

    def __init__(self, conn: psycopg.Connection, spec: OutboxTableSpec) -> None:
        self.conn = conn
        self.channel = spec.notify_channel
        self.wake_lock = spec.wake_lock
        self.sleeper_lock = spec.sleeper_lock
        #: This relay holds the sleeper lock: it takes the wake lock for the idle ones.
        self.watching = False
        #: This relay holds the wake lock: writers notify.
        self.asleep = False
        #: This relay is busy and holds the wake lock shared: no relay sleeps meanwhile.
        self.working = False
        #: No other relay was a member at the last rebalance: nobody else could sleep while
        #: this one works, so a busy spell costs no lock (a relay that joins meanwhile is
        #: told to stop sleeping at this one's next busy turn after its next rebalance).
        self.alone = False
        self._settle_tries = 0
        self._noticed_at = float("-inf")
        #: A relay at work asked for the wake lock: the watcher leaves it until then.
        self._hold_off_until = float("-inf")

    def idle(self, timeout: float) -> bool:
        """Nothing to do: take the watch if free, then sleep, or pause briefly while writers
        are mid-transaction or another relay works. Returns whether to look again at once (a
        NOTIFY ended the wait, or this relay just fell asleep)."""
        if self.asleep:
            return self._wait(timeout)
        if self.working:
            self.conn.execute("SELECT pg_advisory_unlock_shared(%s, %s)", self.wake_lock)
            self.working = False
        if self.watching and time.monotonic() < self._hold_off_until:
            self._settle_tries += 1
            return self._wait(min(settle_pause(self._settle_tries), timeout))
        # One round trip: the watch if free; then, watching, the wake lock and the NOTIFY that
        # makes every relay look once more (commits made before the lock was ours did not
        # notify); not watching, whether the watcher sleeps (holds the wake lock).
        row = self.conn.execute(
            "SELECT watching, asleep, watched, "
            "CASE WHEN asleep THEN pg_notify(%(channel)s, 'relay')::text END "
            "FROM (SELECT CASE WHEN %(watching)s THEN true "
            "ELSE pg_try_advisory_lock(%(s1)s, %(s2)s) END AS watching OFFSET 0) AS w, "
            "LATERAL (SELECT CASE WHEN watching THEN pg_try_advisory_lock(%(w1)s, %(w2)s) "
            "ELSE false END AS asleep OFFSET 0) AS a, "
            "LATERAL (SELECT CASE WHEN watching THEN true "
            "WHEN pg_try_advisory_lock_shared(%(w1)s, %(w2)s) "
            "THEN NOT pg_advisory_unlock_shared(%(w1)s, %(w2)s) "
            "ELSE true END AS watched OFFSET 0) AS x",
            {
                "channel": self.channel,
                "watching": self.watching,
                "s1": self.sleeper_lock[0],
                "s2": self.sleeper_lock[1],
                "w1": self.wake_lock[0],
                "w2": self.wake_lock[1],
            },
        ).fetchone()
        assert row is not None
        self.watching, self.asleep, watched = bool(row[0]), bool(row[1]), bool(row[2])
        if self.asleep:
            self._settle_tries = 0
            return True  # the last look, for commits made before the lock was ours
        if self.watching or not watched:
            # Writers are mid-transaction (any of them may have skipped its NOTIFY) or a relay
            # works: the watcher cannot sleep yet, and nobody else may either while it cannot.
            self._settle_tries += 1
            return self._wait(min(settle_pause(self._settle_tries), timeout))
        self._settle_tries = 0
        return self._wait(timeout)  # the watcher sleeps: writers notify

    def busy(self) -> None:
        """Work was found: hold the wake lock shared while busy (no relay sleeps, writers do
        not notify), and hand the watch back. Costs nothing once the hold is taken."""
        self._settle_tries = 0
        if self.working:
            return
        if self.alone:
            if self.watching:
                self.away()
            return
        if self.watching:
            # Unlocks first, in order, then the shared hold (nobody else holds the lock
            # exclusively: only the watcher takes it so); the NOTIFY (delivered at this
            # statement's commit) tells relays that slept in this one's care to take the
            # watch over.
            unlock_wake = "pg_advisory_unlock(%s, %s), " if self.asleep else ""
            row = self.conn.execute(
                f"SELECT {unlock_wake}pg_advisory_unlock(%s, %s), "
                "pg_notify(%s, 'relay'), pg_try_advisory_lock_shared(%s, %s)",
                (
                    *(self.wake_lock if self.asleep else ()),
                    *self.sleeper_lock,
                    self.channel,
                    *self.wake_lock,
                ),
            ).fetchone()
            self.watching = self.asleep = False
            self.working = row is not None and bool(row[-1])
            return
        # The watcher may sleep: then tell it that a relay works (it lets the lock go), and
        # try again at the next turn.
        now = time.monotonic()
        notice = now - self._noticed_at >= WORKING_NOTICE_INTERVAL
        row = self.conn.execute(
            "SELECT held, CASE WHEN NOT held AND %s THEN pg_notify(%s, %s)::text END "
            "FROM (SELECT pg_try_advisory_lock_shared(%s, %s) AS held OFFSET 0) AS h",
            (notice, self.channel, WORKING, *self.wake_lock),
        ).fetchone()
        self.working = row is not None and bool(row[0])
        if not self.working and notice:
            self._noticed_at = now

    def away(self) -> None:
        """This relay can serve no commit (it owns no shard, stepped aside, cannot publish, is
        stopping): hold nothing, and hand the watch back."""
        if self.working:
            self.conn.execute("SELECT pg_advisory_unlock_shared(%s, %s)", self.wake_lock)
            self.working = False
        if self.watching:
            unlock_wake = "pg_advisory_unlock(%s, %s), " if self.asleep else ""
            self.conn.execute(
                f"SELECT {unlock_wake}pg_advisory_unlock(%s, %s), pg_notify(%s, 'relay')",
                (*(self.wake_lock if self.asleep else ()), *self.sleeper_lock, self.channel),
            )
            self.watching = self.asleep = False
        self._settle_tries = 0

    def forget(self) -> None:
        """The connection is gone, and its locks with it."""
        self.watching = self.asleep = self.working = False
        self._settle_tries = 0

    def _wait(self, timeout: float) -> bool:
        woken = False
        told_working = False
        for notice in self.conn.notifies(timeout=timeout, stop_after=1):
            woken = True
            told_working = notice.payload == WORKING
        for notice in self.conn.notifies(timeout=0):  # fold the wake-ups that queued meanwhile
            told_working = told_working or notice.payload == WORKING
        if told_working and self.asleep:
            # A relay works: let it take its shared hold; writers stop notifying then.
            self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", self.wake_lock)
            self.asleep = False
            self._hold_off_until = time.monotonic() + WORKING_GRACE
        return woken


def settle_pause(tries: int) -> float:
    """The pause after ``tries`` failed tries to take the wake lock: short at first, then
    doubling up to :data:`MAX_SETTLE_PAUSE`."""
    if tries <= SHORT_SETTLE_TRIES:
        return SETTLE_PAUSE
    return min(MAX_SETTLE_PAUSE, SETTLE_PAUSE * 2.0 ** (tries - SHORT_SETTLE_TRIES))
