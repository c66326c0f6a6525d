"""Which idle shards the relay reads next, and how many rows of each (decides, does no I/O).

A relay that keeps up reads every idle shard at once: a transaction's messages, spread over
the shards, go in one batch, and a new row waits for one read. Behind a backlog (the last
read took as many rows as it may), a read takes at most a part of the owned shards, those
read longest ago first, so that one part is read while the others are on their way to Kafka
or being marked: at-least-once a quarter of them (:data:`PIPELINE_PARTS`), exactly-once one
shard (each shard runs its own read, transaction and mark).

A shard a read found empty is not read again until a writer's commit wakes the relay, a
batch's outcome is recorded (no commit wakes a busy relay), or :data:`RELOOK_SECONDS` passed:
a relay with batches in flight does not spin on empty shards, and a new row beside them
waits at most that long.

A batch holds at most :data:`BATCH_BYTES` of records (:func:`within_bytes`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from outbox.relay.commands import Read
from outbox.rows import PendingRow

#: At-least-once, behind a backlog, a read takes at most this part of the owned shards: while
#: one part is read, the others are on their way or being marked. Measured on 16 shards
#: (bench.relay_throughput, one relay): four parts send 15-25% more than two, eight or
#: sixteen about as many as four; one part (a batch at a time) 0.76-0.84 of four.
PIPELINE_PARTS = 4
#: The most bytes of records one batch holds: the producer's queue and the relay's memory
#: stay bounded whatever the batch size and the messages' sizes.
BATCH_BYTES = 32 * 1024 * 1024
#: Seconds before a shard found empty is read again while nothing wakes the relay (it has
#: batches in flight: writers do not notify a busy relay). A new row there waits that long.
RELOOK_SECONDS = 0.1


def shard_window(batch_size: int, shards: int) -> int:
    """How many rows of each shard a read looks at when ``shards`` share a batch: twice
    its share, and at least 100."""
    return max(100, 2 * batch_size // shards)


class ReadPlanner:
    """The reads of one relay's shards: which next, how much, and which were found empty."""

    def __init__(self, batch_size: int, exactly_once: bool) -> None:
        self.batch_size = batch_size
        self.exactly_once = exactly_once
        #: The last read took as many rows as it may: a backlog, read a part at a time.
        self.behind = False
        self._last_read: dict[int, float] = {}
        self._empty_until: dict[int, float] = {}

    def due(self, shards: Sequence[int], now: float) -> list[int]:
        """Those of ``shards`` not waiting after a look that sent nothing."""
        return [s for s in shards if self._empty_until.get(s, float("-inf")) <= now]

    def plan(self, readable: Sequence[int], owned: int, now: float) -> Read | None:
        """The next read of ``readable`` shards (of ``owned``), or None if none is due."""
        due = self.due(readable, now)
        if not due:
            return None
        part = self._part(owned)
        if self.behind:
            due.sort(key=lambda shard: (self._last_read.get(shard, float("-inf")), shard))
            due = due[:part]
        shards = tuple(sorted(due))
        size, per_shard = self.limits(len(shards), part)
        return Read(shards, size, per_shard)

    def limits(self, shards: int, part: int) -> tuple[int, int]:
        """The most rows a read of ``shards`` shards takes, in all and of one shard: a
        shard's window is a part-read's, however many shards are read."""
        if self.exactly_once:
            # A Kafka transaction per shard: each may take a whole batch, so that a backlog
            # costs as few transactions (and their commit round trips) as it can.
            return self.batch_size * shards, self.batch_size
        return self.batch_size, shard_window(self.batch_size, part)

    def read(self, read: Read, rows: Sequence[PendingRow], now: float) -> None:
        """Note what ``read`` found: its empty shards wait, a full read means a backlog."""
        per_shard = Counter(row.shard for row in rows)
        full = len(rows) >= read.size  # (in seq order: a shard with no row may have some)
        for shard in read.shards:
            self._last_read[shard] = now
            if per_shard[shard] == 0 and not full:
                self._empty_until[shard] = now + RELOOK_SECONDS
            else:
                self._empty_until.pop(shard, None)
        if rows:  # an empty read (beside the batches in flight) says nothing of a backlog
            self.behind = full or max(per_shard.values()) >= read.per_shard

    def looked(
        self, read: Read, rows: Sequence[PendingRow], busy: Collection[int], now: float
    ) -> None:
        """The shards of ``read`` that sent nothing (are not ``busy``) wait like empty ones;
        a full read says nothing of those it returned no row of (rows come in seq order)."""
        shards = {row.shard for row in rows} if len(rows) >= read.size else set(read.shards)
        for shard in shards.difference(busy):
            self._empty_until[shard] = now + RELOOK_SECONDS

    def woken(self) -> None:
        """New rows may be anywhere (a commit, a batch recorded): every shard is due again."""
        self._empty_until.clear()

    def relook_at(self) -> float | None:
        """When the first shard found empty is due again (None: none waits)."""
        return min(self._empty_until.values(), default=None)

    def forget(self, shards: Sequence[int] | set[int]) -> None:
        for shard in shards:
            self._last_read.pop(shard, None)
            self._empty_until.pop(shard, None)

    def _part(self, owned: int) -> int:
        """The most shards a read behind a backlog takes."""
        if self.exactly_once:
            return 1
        return max(1, -(-owned // PIPELINE_PARTS))


def within_bytes(rows: list[PendingRow], room: int) -> list[PendingRow]:
    """The first of ``rows`` whose records (keys, values, headers) fit in ``room`` bytes, at
    least one (so that a batch moves)."""
    total = 0
    for position, row in enumerate(rows):
        record = row.record
        if record is not None:
            headers = sum(len(name) + len(value or b"") for name, value in record.headers)
            total += len(record.key or b"") + len(record.value or b"") + headers
        if total > room and position > 0:
            return rows[:position]
    return rows
