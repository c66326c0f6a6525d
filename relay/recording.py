"""Recording a batch's outcome in the background, on the owner session, while the loop goes on.

Marking a batch sent is one statement on the session that holds the shards' locks; it takes
as long as reading the next batch. Run by a worker thread, it no longer stops the loop: the
loop meanwhile serves Kafka, and reads and produces other shards' rows. A batch's shards stay
busy until its outcome is recorded, so none of its rows is read again before it is marked.

Only single autocommit statements are recorded here: psycopg runs one statement of a session
at a time, but a transaction or a pipeline of the loop's own could take in a statement sent
from another thread. The loop waits for what is being recorded (:meth:`OutcomeRecorder.collect`
with ``block=True``) before it runs anything else than single statements on the session.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger("outbox.relay")

T = TypeVar("T")


@dataclass(eq=False)
class Recording(Generic[T]):
    """One outcome being recorded: what the loop finishes once it is (``batch``)."""

    batch: T
    future: Future[None]


class OutcomeRecorder(Generic[T]):
    """One worker thread that runs the loop's outcome statements one after the other."""

    def __init__(self) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-record")
        self._pending: deque[Recording[T]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, batch: T, record: Callable[[], None]) -> None:
        """Start recording ``batch`` with ``record()``, after what was submitted before."""
        self._pending.append(Recording(batch, self._worker.submit(record)))

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the oldest outcome being recorded."""
        if self._pending:
            wait_for_futures([self._pending[0].future], timeout)

    def collect(self, block: bool) -> Iterator[T]:
        """The batches recorded so far, in the order submitted; with ``block``, every one
        submitted, waiting for each. A statement that failed raises its error here (the
        session is lost: see :meth:`abandon`)."""
        while self._pending:
            recording = self._pending[0]
            if not block and not recording.future.done():
                return
            recording.future.result()  # raises the statement's error
            self._pending.popleft()
            yield recording.batch

    def abandon(self) -> None:
        """The session is lost or closing: wait until no statement runs on it, and forget what
        was being recorded (a mark that did not commit leaves its rows pending, to be read
        again by their next owner)."""
        wait_for_futures([recording.future for recording in self._pending])
        for recording in self._pending:
            error = recording.future.exception()
            if error is not None:
                log.debug("outcome not recorded: %s", error)
        self._pending.clear()

    def close(self) -> None:
        self.abandon()
        self._worker.shutdown(wait=True)
