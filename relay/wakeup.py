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
  beside it. Busy relays also hold a *work lock* shared, by which the idle ones know that
  others work: they look again every :data:`WORKING_PAUSE` meanwhile (a row of their
  shards waits that long at most, never their poll interval), not at the short pauses that
  writers mid-transaction call for. A relay that gets work while the watcher sleeps is
  refused the shared hold: it NOTIFYs ``working`` (at most every
  :data:`MAX_SETTLE_PAUSE`), the watcher lets the wake lock go, and the busy relay
  takes its shared hold at its next turn. The watcher takes the wake lock only while no
  relay holds the work lock, so it does not take it back meanwhile.
* A relay that can serve no commit (it owns no shard, or stepped aside) holds nothing
  (:meth:`WakeUp.away`): were it to watch, every writer would notify while the others work.

Writers that find no relay asleep only take a shared lock, and never notify.
"""

from __future__ import annotations

import time

import psycopg

from outbox.schema import OutboxTableSpec

#: First pause, in seconds, before trying again to take the wake lock from writers; writers
#: usually commit within a few milliseconds, and rows they commit meanwhile wait this long.
#: It doubles at each try.
SETTLE_PAUSE = 0.001
#: Longest pause: a transaction left open after inserting, or another relay at work, keeps
#: an idle relay looking this often. Also the least time between two NOTIFYs a relay that
#: got work sends when the sleeping watcher refuses it the shared hold.
MAX_SETTLE_PAUSE = 0.05
#: Payload of that NOTIFY.
WORKING = "working"
#: Pause, in seconds, between the looks of an idle relay while another relay works (it
#: cannot sleep then, and the rows of its shards wait this long at most).
WORKING_PAUSE = MAX_SETTLE_PAUSE


class WakeUp:
    """The wake-up state of one relay, on its autocommit LISTEN connection."""

    def __init__(self, conn: psycopg.Connection, spec: OutboxTableSpec) -> None:
        self.conn = conn
        self.channel = spec.notify_channel
        self.wake_lock = spec.wake_lock
        self.sleeper_lock = spec.sleeper_lock
        #: Held shared by every busy relay, so that an idle one knows that others work (and
        #: looks again at WORKING_PAUSE, not at the short pauses that writers call for).
        self.work_lock = (spec.wake_lock[0], 2)
        #: This relay holds the sleeper lock: it takes the wake lock for the idle ones.
        self.watching = False
        #: This relay holds the wake lock: writers notify.
        self.asleep = False
        #: This relay is busy and holds the wake lock shared: no relay sleeps meanwhile.
        self.working = False
        #: This relay is busy and holds the work lock shared.
        self.marked = False
        self._settle_tries = 0
        self._noticed_at = float("-inf")

    def idle(self, timeout: float) -> bool:
        """Nothing to do: take the watch if free, then sleep, or pause briefly while writers
        are mid-transaction or another relay works. Returns whether to look again at once (a
        NOTIFY ended the wait, or this relay just fell asleep)."""
        if self.asleep:
            return self._wait(timeout)
        self._release_holds()
        # One round trip: the watch if free; whether other relays work (hold the work lock);
        # then, watching and nobody working, the wake lock and the NOTIFY that makes every
        # relay look once more (commits made before the lock was ours did not notify); not
        # watching, whether the watcher sleeps (holds the wake lock).
        row = self.conn.execute(
            "SELECT watching, asleep, watched, others_work, "
            "CASE WHEN asleep THEN pg_notify(%(channel)s, 'relay')::text END "
            "FROM (SELECT CASE WHEN %(watching)s THEN true "
            "ELSE pg_try_advisory_lock(%(s1)s, %(s2)s) END AS watching OFFSET 0) AS w, "
            "(SELECT CASE WHEN pg_try_advisory_lock(%(k1)s, %(k2)s) "
            "THEN NOT pg_advisory_unlock(%(k1)s, %(k2)s) "
            "ELSE true END AS others_work OFFSET 0) AS o, "
            "LATERAL (SELECT CASE WHEN watching AND NOT others_work "
            "THEN pg_try_advisory_lock(%(w1)s, %(w2)s) "
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
                "k1": self.work_lock[0],
                "k2": self.work_lock[1],
            },
        ).fetchone()
        assert row is not None
        self.watching, self.asleep, watched = bool(row[0]), bool(row[1]), bool(row[2])
        if self.asleep:
            self._settle_tries = 0
            return True  # the last look, for commits made before the lock was ours
        if row[3]:
            # Other relays work: nobody sleeps, writers do not notify, and this relay looks
            # again at a pace that costs the database little.
            return self._wait(min(WORKING_PAUSE, timeout))
        if self.watching or not watched:
            # Writers are mid-transaction, and any of them may have skipped its NOTIFY: the
            # watcher cannot sleep yet, and nobody else may either while it cannot.
            self._settle_tries += 1
            return self._wait(min(settle_pause(self._settle_tries), timeout))
        self._settle_tries = 0
        return self._wait(timeout)  # the watcher sleeps: writers notify

    def busy(self) -> None:
        """Work was found: hold the wake lock shared while busy (no relay sleeps, writers do
        not notify), and hand the watch back. Costs nothing once the hold is taken."""
        self._settle_tries = 0
        if self.working and self.marked:
            return
        if self.watching:
            self.away()  # hands the watch over: relays that slept in its care take it
        # The work lock is only ever held exclusively for the length of one statement (an
        # idle relay's look): waiting for it is waiting for that statement. The wake lock is
        # refused while the watcher sleeps: then tell it that a relay works (it lets the
        # lock go), and try again at the next turn.
        now = time.monotonic()
        notice = now - self._noticed_at >= MAX_SETTLE_PAUSE
        row = self.conn.execute(
            "SELECT held, CASE WHEN NOT held AND %(notice)s "
            "THEN pg_notify(%(channel)s, %(payload)s)::text END "
            "FROM (SELECT CASE WHEN %(mark)s "
            "THEN pg_advisory_lock_shared(%(k1)s, %(k2)s)::text END AS marked, "
            "CASE WHEN %(hold)s THEN pg_try_advisory_lock_shared(%(w1)s, %(w2)s) "
            "ELSE true END AS held OFFSET 0) AS h",
            {
                "notice": notice,
                "channel": self.channel,
                "payload": WORKING,
                "mark": not self.marked,
                "hold": not self.working,
                "k1": self.work_lock[0],
                "k2": self.work_lock[1],
                "w1": self.wake_lock[0],
                "w2": self.wake_lock[1],
            },
        ).fetchone()
        self.marked = True
        self.working = row is not None and bool(row[0])
        if not self.working and notice:
            self._noticed_at = now

    def away(self) -> None:
        """This relay can serve no commit (it owns no shard, stepped aside, cannot publish, is
        stopping): hold nothing, and hand the watch back."""
        self._release_holds()
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
        self.watching = self.asleep = self.working = self.marked = False
        self._settle_tries = 0

    def _release_holds(self) -> None:
        """Let go of what a busy spell held (one round trip, none if nothing is held)."""
        if not (self.working or self.marked):
            return
        self.conn.execute(
            "SELECT CASE WHEN %(hold)s THEN pg_advisory_unlock_shared(%(w1)s, %(w2)s) END, "
            "CASE WHEN %(mark)s THEN pg_advisory_unlock_shared(%(k1)s, %(k2)s) END",
            {
                "hold": self.working,
                "mark": self.marked,
                "w1": self.wake_lock[0],
                "w2": self.wake_lock[1],
                "k1": self.work_lock[0],
                "k2": self.work_lock[1],
            },
        )
        self.working = self.marked = False

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
            # The busy relay holds the work lock: this one will not take the wake lock again
            # before it is idle.
            self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", self.wake_lock)
            self.asleep = False
        return woken


def settle_pause(tries: int) -> float:
    """The pause after ``tries`` failed tries to take the wake lock: :data:`SETTLE_PAUSE`,
    doubling up to :data:`MAX_SETTLE_PAUSE`."""
    return min(MAX_SETTLE_PAUSE, SETTLE_PAUSE * 2.0 ** min(max(0, tries - 1), 32))
