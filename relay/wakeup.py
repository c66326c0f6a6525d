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

Busy relays hold nothing: writers then only take a shared lock, and never notify.
"""

from __future__ import annotations

import psycopg

from outbox.schema import OutboxTableSpec

#: Pause, in seconds, before trying again to take the wake lock from writers; writers
#: usually commit within a few milliseconds, and rows they commit meanwhile wait this long.
SETTLE_PAUSE = 0.001
#: Tries at that pause before the pause doubles.
SHORT_SETTLE_TRIES = 10
#: Longest pause: a transaction left open after inserting keeps a relay looking this often.
MAX_SETTLE_PAUSE = 0.05


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
        self._settle_tries = 0

    def idle(self, timeout: float) -> bool:
        """Nothing to do: take the watch if free, then sleep, or pause briefly while writers
        are mid-transaction. Returns whether to look again at once (a NOTIFY ended the wait,
        or this relay just fell asleep)."""
        if self.asleep:
            return self._wait(timeout)
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
            # Writers are mid-transaction, and any of them may have skipped its NOTIFY: the
            # watcher cannot sleep yet, and nobody else may either while it cannot.
            self._settle_tries += 1
            return self._wait(min(settle_pause(self._settle_tries), timeout))
        self._settle_tries = 0
        return self._wait(timeout)  # the watcher sleeps: writers notify

    def busy(self) -> None:
        """Work was found: stop making writers notify, and hand the watch back."""
        if not self.watching:
            return
        # Unlocks first, in order; the NOTIFY (delivered at this statement's commit) tells
        # relays that slept in this one's care to take the watch over.
        unlock_wake = "pg_advisory_unlock(%s, %s), " if self.asleep else ""
        self.conn.execute(
            f"SELECT {unlock_wake}pg_advisory_unlock(%s, %s), pg_notify(%s, 'relay')",
            (*(self.wake_lock if self.asleep else ()), *self.sleeper_lock, self.channel),
        )
        self.watching = self.asleep = False
        self._settle_tries = 0

    def forget(self) -> None:
        """The connection is gone, and its locks with it."""
        self.watching = self.asleep = False
        self._settle_tries = 0

    def _wait(self, timeout: float) -> bool:
        woken = False
        for _ in self.conn.notifies(timeout=timeout, stop_after=1):
            woken = True
        for _ in self.conn.notifies(timeout=0):  # fold the wake-ups that queued meanwhile
            pass
        return woken


def settle_pause(tries: int) -> float:
    """The pause after ``tries`` failed tries to take the wake lock: short at first, then
    doubling up to :data:`MAX_SETTLE_PAUSE`."""
    if tries <= SHORT_SETTLE_TRIES:
        return SETTLE_PAUSE
    return min(MAX_SETTLE_PAUSE, SETTLE_PAUSE * 2.0 ** (tries - SHORT_SETTLE_TRIES))
