"""Reading the next rows of idle shards and starting them on their way to Kafka.

Invariant: a shard has at most one batch in flight. A read asks only for owned shards that
are idle: none of its batches is in flight or being recorded (``_busy_shards``), and it is not
being taken over. The rows read go to the publisher at once, and their shards are busy from
then until their outcome is recorded: so nothing is sent twice by one relay, and a key's
messages go in order, also across retries.

The owned shards are read in groups (at-least-once a quarter of them each,
:data:`READ_GROUPS`; exactly-once one shard each), in turn, while the relay is behind (its
last read took as many rows as it may): one group is read while the others' batches are in
flight or being marked. A relay that keeps up reads every idle shard at once. Either way a
read waits, while batches are in flight, for a group's worth of idle shards, but never for
shards whose outcome waits for another transaction's row lock. The
groups are an optimization: no guarantee depends on how many there are.

Assumes: :mod:`outbox.relay.marking` keeps a batch's shards busy until its outcome is
recorded (and the shards of rows another transaction holds locked until they are marked);
:mod:`outbox.relay.rebalancing` lets a shard go
only with nothing of it in flight; the read itself reads nothing once the owner session is gone
(:mod:`outbox.relay.sessions`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import psycopg

from outbox.relay.policy import UNDECODABLE
from outbox.relay.state import RelayState
from outbox.relay.store import Failure, PendingRow, shard_window
from outbox.relay.tracing import start_batch_span
from outbox.schema import SHARD_COUNT

log = logging.getLogger("outbox.relay")

#: At-least-once, the owned shards are read in this many groups, in turn: while one group is
#: read, the others are on their way to Kafka or being marked. Measured on 16 shards
#: (bench.relay_throughput, one relay): four groups send 15-25% more than two, eight or sixteen
#: about as many as four.
READ_GROUPS = 4
#: Exactly-once, each shard is a group of its own: read as soon as it is idle, so that each
#: shard runs its own read -> transaction -> mark. Its read takes a whole batch per shard (a
#: transaction each); in groups of four, a transaction waited for its group's four batches to be
#: read, and their marks came as one. Measured on 16 shards, one relay, side by side in ten
#: rounds: a median 11% more messages a second than four groups (0-23%).
EXACTLY_ONCE_READ_GROUPS = SHARD_COUNT
#: Beside the same batches in flight (one long transaction, a mark waiting for a row lock), the
#: idle shards are all looked at again after this many seconds: a new row on one of them waits
#: at most about this long, not for the groups' turns (up to 16 loop steps exactly-once).
LOOK_BESIDE_AGAIN = 0.1


class BatchReading(RelayState):
    """Reading and starting batches (a part of :class:`~outbox.relay.daemon.Relay`)."""

    #: The groups the owned shards are read in: a read waits, while batches are in flight,
    #: until a group's worth of shards is idle (1: all of them, so one batch at a time; as
    #: many groups as shards: every shard read as soon as it is idle). An optimization no
    #: guarantee depends on: the model-based test draws its value. None: READ_GROUPS, or
    #: EXACTLY_ONCE_READ_GROUPS in exactly-once mode.
    read_groups: int | None = None
    #: The shards in flight when a look at every idle shard beside them last found nothing,
    #: and when (time.monotonic()).
    _looked_beside: frozenset[int] = frozenset()
    _looked_beside_at: float = 0.0

    def _start_next(self) -> bool:
        """Read the next rows of idle shards and start sending them; False if there were none.

        Behind (the last read that found rows took as many as it may, in all or of one shard),
        the read waits until a group's worth of the owned shards (see READ_GROUPS) is idle,
        and it takes at most that many: one group is read while the others are in flight or
        being marked; a group that holds nothing is followed at once by the other idle shards,
        a quarter of the owned shards at a time, so that rows that woke the relay are never
        left for the next wake-up, nor (while the shards in flight change) a shard's backlog
        for the groups' turns. Not behind,
        every idle shard is read at once: a transaction's messages, spread over the shards, go
        in one batch, and a new row waits for one read.
        """
        assert self._ownership is not None and self._publisher is not None
        assert self._reader is not None
        self.store.before_read(self._ownership.owned, self._reader, self._owner_key)
        owned = sorted(self._ownership.owned)
        busy = {shard for shards, _, _ in self._busy_shards.values() for shard in shards}
        busy |= self._take_overs.shards
        idle = [shard for shard in owned if shard not in busy]
        groups = self.read_groups or (
            EXACTLY_ONCE_READ_GROUPS if self.config.exactly_once else READ_GROUPS
        )
        group = max(1, -(-len(owned) // groups))  # shards per group, rounded up
        groups = max(1, -(-len(owned) // group))  # the turns: fewer owned shards, fewer groups
        # Shards held by another transaction's row lock may stay busy for long: the read
        # waits for no more idle shards than the others can give.
        if not idle or (busy and len(idle) < min(group, len(owned) - len(self._stuck_shards))):
            return False
        shards = idle
        if len(owned) > 1 and len(idle) > group and self._behind:
            # Groups in turn, so that the batches in flight keep to their own shards.
            first = [s for s in idle if owned.index(s) // group == self._group]
            shards = (first or idle)[:group]
            self._group = (self._group + 1) % groups
        started = time.monotonic()
        batch = self._read(shards, group)
        # A group that holds nothing is followed at once by the other idle shards, also
        # beside batches in flight: a backlog of one shard never waits for the groups' turns
        # to come round to it. A quarter of the owned shards (at least a group) at a time:
        # rows found in one part go while the next is read, and one-shard groups do not cost a
        # read per empty shard. Beside batches in flight, only once the shards in flight
        # changed since the last such look found nothing, or LOOK_BESIDE_AGAIN later: the loop
        # steps often while they are in flight, and a new row on an idle shard (no commit
        # wakes a relay with batches in flight) waits at most that long for the next look.
        rest = [shard for shard in idle if shard not in shards]
        now = time.monotonic()
        part = max(group, -(-len(owned) // READ_GROUPS))
        if busy and not batch and busy == self._looked_beside:
            # Looked beside these batches already: again only LOOK_BESIDE_AGAIN later, and then
            # in one read of every idle shard (as a relay that keeps up reads), not a part at a
            # time: there is mostly a row or two to find, and a read's limits hold all the same.
            looked_lately = now - self._looked_beside_at < LOOK_BESIDE_AGAIN
            rest, part = ([], part) if looked_lately else (rest, len(rest))
        looked = bool(rest)
        while not batch and rest:
            shards, rest = rest[:part], rest[part:]
            batch = self._read(shards, group)
        if busy and not batch and looked:
            self._looked_beside, self._looked_beside_at = frozenset(busy), now
        if batch or not busy:  # (empty shards read beside a batch in flight say nothing)
            # As many rows as the read may take, in all or of one shard: a backlog, read a
            # group at a time so that several batches are in flight. Fewer: rows are read as
            # they are written, every idle shard at once, so that a new row waits for one
            # read, not one a group.
            size, per_shard = self._limits(len(shards), group)
            most_of_one = max(Counter(row.shard for row in batch).values(), default=0)
            self._behind = len(batch) >= size or most_of_one >= per_shard
        if not batch:
            self.health.batch_done(progressed=True)  # nothing to send is not being stuck
            return False
        undecodable = [
            Failure(row.id, UNDECODABLE, row.problem or UNDECODABLE, None)
            for row in batch
            if row.record is None
        ]
        if undecodable:
            self._collect_recordings(block=True)  # a transaction: alone on the session
            try:
                with self.health.marking():
                    self.store.record_outcome([], undecodable, connection=self._conn)
            except psycopg.errors.LockNotAvailable:
                # Another transaction holds one of them locked (MARK_LOCK_TIMEOUT_MS): they
                # stay pending, to be read and recorded again; the loop goes on.
                log.warning("recording %d undecodable rows waits for a row lock", len(undecodable))
            else:
                self._observe_failures(undecodable, {row.id: "?" for row in batch})
        records = [row.record for row in batch if row.record is not None]
        if not records:
            return True
        for row in batch:
            if row.record is not None:
                self._rows[row.id.int] = row
        for flight in self._publisher.start(records):
            in_flight = {record.shard for record in flight.records}
            # A trace span per batch, linked to its messages' contexts (with OpenTelemetry).
            self._busy_shards[flight] = (in_flight, started, start_batch_span(flight.records))
        self.metrics.batch_size.observe(len(batch))
        return True

    def _read(self, shards: list[int], group: int) -> list[PendingRow]:
        """The next rows of ``shards``; each shard's window is a group-read's (``group``
        shards), however many shards are read."""
        size, per_shard = self._limits(len(shards), group)
        return self.store.read_batch(shards, size, self._reader, per_shard, self._owner_key)

    def _limits(self, shards: int, group: int) -> tuple[int, int]:
        """The most rows a read of ``shards`` shards takes, in all and of one shard."""
        if self.config.exactly_once:
            # A Kafka transaction per shard: each may take a whole batch, so that a backlog
            # costs as few transactions (and their commit round trips) as it can.
            return self.config.batch_size * shards, self.config.batch_size
        return self.config.batch_size, shard_window(self.config.batch_size, group)
