"""Recording a batch's outcome in the background while the loop goes on.

Marking a batch sent is one statement; it takes as long as reading the next batch. Run by
worker threads, each on a session of its own beside the one that holds the shards' locks
(the statement marks only rows of shards that session still holds), it no longer stops the
loop: the loop meanwhile serves Kafka, and reads and produces other shards' rows, and marks of
different shards run side by side. A batch's shards stay busy until its outcome is recorded,
so none of its rows is read again before it is marked, and no two marks being recorded touch
the same shard.

A mark may come back unfinished (rows another transaction holds locked): ``record`` then
returns the seconds after which to run it again, and its batch stays being recorded (its shards
busy) until it is, aging from its first submission, whatever it tries meanwhile.

Outcomes with failures are recorded here too, each in one transaction on a marking session.
Only rows that cannot be turned into a record are recorded by the loop itself (a transaction
on the owner session), after it waited for what is being recorded
(:meth:`OutcomeRecorder.collect` with ``block=True``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger("outbox.relay")

T = TypeVar("T")


@dataclass(eq=False)
class Recording(Generic[T]):
    """One outcome being recorded: what the loop finishes once it is (``batch``)."""

    batch: T
    record: Callable[[], float | None]
    #: The statement running (None: waiting to be run again, at ``retry_at``).
    future: Future[float | None] | None
    #: When it was submitted (time.monotonic()): a mark blocked on a row lock ages from here.
    submitted: float = field(default_factory=time.monotonic)
    retry_at: float = 0.0


class OutcomeRecorder(Generic[T]):
    """Worker threads that run the loop's outcome statements; the loop collects each as soon
    as it is recorded, whatever was submitted before it: the outcomes being recorded are of
    different shards, and one slow statement must not keep the shards of the batches recorded
    after it busy."""

    def __init__(self, workers: int = 1) -> None:
        self._worker = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="outbox-record")
        self._pending: deque[Recording[T]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, batch: T, record: Callable[[], float | None]) -> None:
        """Start recording ``batch`` with ``record()`` (beside what was submitted before, with
        several workers: each ``record`` names its own session). ``record`` returns None once
        the outcome is recorded, else the seconds after which to call it again."""
        self._pending.append(Recording(batch, record, self._worker.submit(record)))

    @property
    def running(self) -> int:
        """How many statements run now (the rest wait to be tried again)."""
        return sum(1 for recording in self._pending if recording.future is not None)

    def retrying(self) -> list[T]:
        """The batches whose outcome was recorded in part, waiting to be tried again."""
        return [recording.batch for recording in self._pending if recording.future is None]

    def oldest_submitted(self) -> float | None:
        """When the outcome being recorded the longest was submitted (None: none is)."""
        return min((recording.submitted for recording in self._pending), default=None)

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for any outcome being recorded to be recorded, or
        the next one waiting to be tried again to be due."""
        running = [r.future for r in self._pending if r.future is not None]
        due = min((r.retry_at for r in self._pending if r.future is None), default=None)
        if due is not None:
            timeout = min(timeout, max(0.0, due - time.monotonic()))
        if running:
            wait_for_futures(running, timeout, FIRST_COMPLETED)
        elif due is not None:
            time.sleep(timeout)

    def collect(self, block: bool) -> Iterator[T]:
        """The batches recorded so far, in the order submitted, passing over those still being
        recorded; with ``block``, every one running, waiting for each (those waiting to be
        tried again are run when due, not waited for). A statement that failed raises its
        error here (the session is lost: see :meth:`abandon`)."""
        for recording in list(self._pending):
            if recording.future is None:
                if time.monotonic() >= recording.retry_at:
                    recording.future = self._worker.submit(recording.record)
                continue
            if not block and not recording.future.done():
                continue
            again = recording.future.result()  # raises the statement's error
            if again is not None:
                recording.future, recording.retry_at = None, time.monotonic() + again
                continue
            self._pending.remove(recording)
            yield recording.batch

    def abandon(self) -> None:
        """The sessions are lost or closing: wait until no statement runs on them, and forget what
        was being recorded (a mark that did not commit leaves its rows pending, to be read
        again by their next owner)."""
        running = [r.future for r in self._pending if r.future is not None]
        wait_for_futures(running)
        for future in running:
            error = future.exception()
            if error is not None:
                log.debug("outcome not recorded: %s", error)
        self._pending.clear()

    def close(self) -> None:
        self.abandon()
        self._worker.shutdown(wait=True)
