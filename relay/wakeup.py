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
  reaches every listener. Others sleep until a NOTIFY or their poll interval. The watching
  relay NOTIFYs again when it gets work and lets go, so the others never sleep unwatched.

Busy relays hold nothing: writers then only take a shared lock, and never notify.
"""

from __future__ import annotations

import psycopg

from outbox.schema import OutboxTableSpec

#: First pause, in seconds, before trying again to take the wake lock from writers.
FIRST_SETTLE_PAUSE = 0.001
#: Longest such pause: a transaction left open after inserting keeps relays looking this often.
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
        self._pause = FIRST_SETTLE_PAUSE

    def idle(self, timeout: float) -> bool:
        """Nothing to do: take the watch if free, then sleep (or pause briefly while writers
        are mid-transaction). Returns whether a NOTIFY ended the wait."""
        if not self.watching:
            self.watching = self._try_lock(self.sleeper_lock)
            if not self.watching:
                return self._wait(timeout)  # another relay watches and will wake us
        if not self.asleep:
            if not self._try_lock(self.wake_lock):
                pause, self._pause = self._pause, min(MAX_SETTLE_PAUSE, self._pause * 2)
                return self._wait(min(pause, timeout))
            self.asleep = True
            self._pause = FIRST_SETTLE_PAUSE
            # Commits made before the lock was ours did not notify: everyone looks once more.
            self._notify()
        return self._wait(timeout)

    def busy(self) -> None:
        """Work was found: stop making writers notify, and hand the watch back."""
        if not self.watching:
            return
        if self.asleep:
            self._unlock(self.wake_lock)
            self.asleep = False
        self._unlock(self.sleeper_lock)
        self.watching = False
        self._pause = FIRST_SETTLE_PAUSE
        self._notify()  # relays that slept in this one's care take the watch over

    def forget(self) -> None:
        """The connection is gone, and its locks with it."""
        self.watching = self.asleep = False
        self._pause = FIRST_SETTLE_PAUSE

    def _wait(self, timeout: float) -> bool:
        woken = False
        for _ in self.conn.notifies(timeout=timeout, stop_after=1):
            woken = True
        for _ in self.conn.notifies(timeout=0):  # fold the wake-ups that queued meanwhile
            pass
        return woken

    def _try_lock(self, lock: tuple[int, int]) -> bool:
        row = self.conn.execute("SELECT pg_try_advisory_lock(%s, %s)", lock).fetchone()
        return bool(row and row[0])

    def _unlock(self, lock: tuple[int, int]) -> None:
        self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", lock)

    def _notify(self) -> None:
        self.conn.execute("SELECT pg_notify(%s, 'relay')", (self.channel,))
