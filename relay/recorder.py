"""Recording outcomes on the outbox table, in the background, on the marking sessions.

Marking a batch sent is one statement; it takes about as long as reading the next batch. Run
by worker threads, each on a session of its own (:data:`MARKERS`), it does not stop the loop:
meanwhile the loop serves Kafka and reads and sends other shards' rows. Each statement names
the owner session (``owner_key``, see the ``owner_alive`` query) and records nothing once it
is gone, with the shards' locks.

A record never waits long for another transaction's row lock (an operator's UPDATE, a long
``outbox dead retry``): sent marks wait at most ``MARK_LOCK_TIMEOUT_MS``, failures not at
all. The rows held are answered back (:class:`~outbox.relay.commands.Recorded`), to be tried
again without waiting; the core keeps their shards busy meanwhile. Failures (a retry later,
dead) are committed with the disk flush whatever the session's setting: a forgotten one would
send a message again after later messages of its key.
"""

from __future__ import annotations

import logging
import queue
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import psycopg

from outbox.relay.commands import Recorded, Recording
from outbox.relay.config import RelayConfig
from outbox.relay.connections import open_session
from outbox.relay.observability import RelayMetrics
from outbox.relay.store import RelayStore

log = logging.getLogger("outbox.relay")

#: Sessions that record outcomes, side by side (four measured as fast as two).
MARKERS = 2


class Recorder:
    """Worker threads that record what the core asks, each on a marking session."""

    def __init__(
        self,
        config: RelayConfig,
        store: RelayStore,
        metrics: RelayMetrics,
        post: Callable[[Recorded | BaseException], None],
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self._post = post
        self._pool = ThreadPoolExecutor(max_workers=MARKERS, thread_name_prefix="outbox-record")
        self._sessions: list[psycopg.Connection] = []
        self._free: queue.SimpleQueue[psycopg.Connection] = queue.SimpleQueue()
        self._owner_key = 0
        self._running: set[Future[None]] = set()
        #: Recordings tried before (held by a row lock): tried again without waiting.
        self._tried: set[int] = set()

    def connect(self, owner_key: int, name: str) -> None:
        opened: list[psycopg.Connection] = []
        try:
            for _ in range(MARKERS):
                opened.append(open_session(self.config, f"{name}/mark", marking=True))
                if not self.store.owner_alive(opened[-1], owner_key):
                    raise psycopg.OperationalError(
                        "a relay session does not see its owner session's lock: are they on"
                        " the same server and database?"
                    )
        except BaseException:
            for session in opened:
                session.close()
            raise
        self._sessions, self._owner_key = opened, owner_key
        self._free = queue.SimpleQueue()
        for session in opened:
            self._free.put(session)

    @property
    def connected(self) -> bool:
        return len(self._sessions) == MARKERS and not any(s.closed for s in self._sessions)

    def submit(self, recording: Recording) -> None:
        """Record ``recording`` on a free session; :class:`Recorded` is posted when done.
        At most one statement runs per session: the core submits no more than there are
        sessions at once, or waits in the pool's queue."""
        free, owner_key = self._free, self._owner_key
        future = self._pool.submit(self._record, recording, free, owner_key)
        self._running.add(future)
        future.add_done_callback(self._running.discard)

    def abandon(self) -> None:
        """The sessions are lost or closing: wait until no statement runs on them."""
        wait(list(self._running))
        self._tried.clear()

    def forget(self) -> None:
        self.abandon()
        for session in self._sessions:
            session.close()
        self._sessions = []

    def close(self) -> None:
        self.forget()
        self._pool.shutdown(wait=True)

    def _record(
        self,
        recording: Recording,
        free: queue.SimpleQueue[psycopg.Connection],
        owner_key: int,
    ) -> None:
        try:
            session = free.get(timeout=60)
        except queue.Empty:
            return  # the sessions were replaced meanwhile: the recording is forgotten
        try:
            held = self._statements(recording, session, owner_key)
        except psycopg.Error as error:
            self._post(error)
            return
        finally:
            free.put(session)
        self._post(Recorded(recording, frozenset(held)))

    def _statements(
        self, recording: Recording, session: psycopg.Connection, owner_key: int
    ) -> set[uuid.UUID]:
        """Run the recording's statements; returns the ids another transaction holds."""
        again = recording.number in self._tried
        acks, failures = recording.acks, recording.failures
        try:
            if not failures and not again:
                try:
                    self.store.mark_acked(acks, session, owner_key)
                    return set()
                except psycopg.errors.LockNotAvailable:  # waited MARK_LOCK_TIMEOUT_MS
                    pass
            held = self.store.record_unlocked(acks, failures, session, owner_key)
        except psycopg.errors.LockNotAvailable:
            # The table itself is locked (a migration, say): nothing was recorded.
            held = [(row, recording.shard_of.get(row, -1), None) for row in recording.shard_of]
        ids = {row_id for row_id, _, _ in held}
        if held and not again:
            self.metrics.marks_blocked.inc()
            log.warning(
                "recording the outcome of %d messages waits for row locks of other "
                "transactions (pids %s): shards %s wait until they go; the others were "
                "recorded",
                len(held),
                sorted({pid for _, _, pid in held if pid is not None}),
                sorted({shard for _, shard, _ in held}),
                extra={"message_ids": [str(row_id) for row_id in ids]},
            )
        elif not held and again:
            log.warning("recorded the outcome of the rows other transactions held locked")
        if held:
            self._tried.add(recording.number)
        else:
            self._tried.discard(recording.number)
        return ids
