"""Shard take-overs in the background, while the loop keeps sending the other shards.

Taking a shard over exactly-once asks Kafka's transaction coordinator to fence the last
owner's producer (``init_transactions``), then reads the shard's progress record and marks its
rows sent. That takes from a few hundred milliseconds to a minute (a coordinator moving to
another broker); run inside the loop, one shard after another, it held every other shard's
messages for as long. Here each take-over (the shards one rebalance gained) runs on a thread
of its own: its shards are owned (locked) but not read until it ended, and the loop goes on
with the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass


@dataclass(eq=False)
class TakeOver:
    """The take-over of ``shards``; ``future`` gives what it recovered: the rows it marked
    sent from committed progress, and the leases of earlier relay versions it took back."""

    shards: tuple[int, ...]
    future: Future[tuple[int, int]]
    #: When it started (time.monotonic()).
    began: float

    def error(self) -> BaseException | None:
        return self.future.exception()


class TakeOvers:
    """Take-overs running in the background; the loop collects each once it ended."""

    def __init__(self, workers: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="outbox-take")
        self._running: list[TakeOver] = []

    def start(self, shards: Sequence[int], take_over: Callable[[], tuple[int, int]]) -> None:
        """Run ``take_over`` (of ``shards``) on a thread; collect it with :meth:`ended`."""
        future = self._pool.submit(take_over)
        self._running.append(TakeOver(tuple(shards), future, time.monotonic()))

    @property
    def shards(self) -> set[int]:
        """The shards being taken over: owned, but not to be read yet."""
        return {shard for take_over in self._running for shard in take_over.shards}

    def oldest_start(self) -> float | None:
        """When the oldest take-over still running started (None: none runs)."""
        return min((t.began for t in self._running), default=None)

    def __len__(self) -> int:
        return len(self._running)

    def wait(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds (None: for ever) for a take-over to end."""
        if self._running:
            wait_for_futures([t.future for t in self._running], timeout, FIRST_COMPLETED)

    def ended(self, wait_for_all: bool = False) -> list[TakeOver]:
        """The take-overs that ended (with ``wait_for_all``, every one, waited for)."""
        if wait_for_all:
            wait_for_futures([t.future for t in self._running])
        done = [t for t in self._running if t.future.done()]
        self._running = [t for t in self._running if t not in done]
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)
