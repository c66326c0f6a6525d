"""The outbox's committed messages from PostgreSQL's logical decoding, as the relay's source.

Built on :class:`outbox.wal.WalReader`: the rows the business transactions insert come out of
the outbox's replication slot as they commit, in commit order, and this source hands them to
the core by shard, as :class:`~outbox.rows.PendingRow` objects, the way the table source does.
Nothing is written back per message: what was sent is what the *settled position* covers, and
the rare failures are recorded on the rows by the recorder, as in table mode.

It keeps the rules of a source (:mod:`outbox.relay.table_source`):

- **Order.** Each shard's rows come in commit order. A message whose failure was recorded
  with a retry waits aside, in memory, until it is due (the table holds its attempts and
  ``next_attempt_at``); its key's later messages wait behind it, other keys go on.
- **Once.** The core reads a shard only when nothing of it is in flight or being recorded, so
  when a shard is read, whatever of it was handed out and not settled came back unsettled (an
  outage, a suspect sent alone next, a batch forgotten): it is handed out again first, in its
  order. A row is *settled* once its outcome is recorded (:meth:`WalSource.recorded`): sent,
  dead, or a retry written on its row; it is never handed out again after that.
- **Ownership.** The slot has one reader: while this source streams it, no other can.

**The settled position** (:meth:`WalSource.settled`) is the end of the last transaction (or
heartbeat) that, with every one before it, is settled: the slot may be confirmed there once
the caller has recorded it durably (:meth:`WalSource.confirm`). A transaction whose rows are
still in flight holds it back, however many later ones are settled. With it comes the
*horizon*: the oldest transaction still running in a snapshot taken at a WAL position at or
before the settled position. Every message committed after the position was written by a
transaction no older than the horizon, so after a lost slot
:func:`~outbox.relay.wal_rows.unsettled_rows` finds, in the table, every message the slot
had not confirmed (and some it had: duplicates).

**A restart** (a new source from the recorded position) gets again from the slot every
transaction not confirmed. Rows of transactions committed before the source started may have
been settled by the source before it; the table says which must not go again (dead, waiting
aside, sent or gone), one look-up by primary key per read of them, and the rows waiting aside
are read from the table's retry index at start.

Not yet here (docs/relay.md, "Another source"): recording the position durably, the WAL-mode
recorder (acknowledged rows need no statement, but those that waited aside are marked sent:
the retry index would otherwise hand them out again at the next start), a key's later
messages marked aside in the table so that the slot does not wait on them, recovery from a
lost slot, the standby relays.
Everything runs on the caller's thread.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import sqlalchemy as sa

from outbox.relay.commands import Read, Recorded
from outbox.relay.wal_rows import WalStatements, pending_row_of_message
from outbox.rows import PendingRow, pending_row_of
from outbox.schema import DEFAULT_SPEC, OutboxTableSpec
from outbox.wal.pgoutput import Begin, Commit, WalMessage
from outbox.wal.reader import HEARTBEAT_SECONDS, Heartbeat, Item, WalReader, libpq_conninfo

if TYPE_CHECKING:
    from outbox.relay.driver import Source

#: The most rows taken in from the stream and not handed out yet: behind a slow Kafka the
#: source stops reading the stream (and keeps it alive) rather than hold all of it.
BUFFER_ROWS = 50_000
#: Seconds between the standby status updates sent while the stream is not read (a full
#: buffer): the server ends a stream it has heard nothing from for ``wal_sender_timeout``.
KEEP_ALIVE_SECONDS = 1.0
#: Seconds between snapshots taken for the horizon: a lost slot sends again about this much
#: more than it lost (and whatever transactions ran long meanwhile).
HORIZON_SECONDS = 1.0
#: Raw stream messages taken in by one call to the reader.
PULL_ITEMS = 10_000


@dataclass(frozen=True)
class Settled:
    """Up to where the stream is done with: everything committed before ``position`` was
    settled. ``horizon`` (a 64-bit transaction id, None until a snapshot is covered): every
    message committed after ``position`` was written by a transaction at least as new."""

    position: int
    horizon: int | None


@dataclass(slots=True, eq=False)
class _Span:
    """One transaction of the stream (or a heartbeat): its end, once its Commit came, and how
    many of its rows are not settled yet."""

    end: int | None
    waiting: int = 0


@dataclass(slots=True, eq=False)
class _Entry:
    """A row the source holds: where it stands in the stream, its transaction (None once
    settled) and, waiting aside, when it is due."""

    row: PendingRow
    index: int
    span: _Span | None
    key: tuple[str, bytes] | None
    due: float | None = None


def _key_of(row: PendingRow) -> tuple[str, bytes] | None:
    """What orders a row among others (a key's messages go in order; no key, no order)."""
    record = row.record
    if record is None or record.key is None:
        return None
    return (record.topic, record.key)


class WalSource:
    """The outbox table's slot, read for one relay (see the module's text).

    ``url``: the database (SQLAlchemy URL, psycopg 3); the role needs ``REPLICATION`` and
    ``SELECT`` on the table. ``position`` and ``horizon``: what the caller last recorded
    (None on a first start: the slot is made, or taken as it stands). ``clock``: seconds,
    for the retries' due times.
    """

    def __init__(
        self,
        url: str | sa.URL,
        spec: OutboxTableSpec = DEFAULT_SPEC,
        *,
        position: int | None = None,
        horizon: int | None = None,
        heartbeat: float | None = HEARTBEAT_SECONDS,
        buffer_rows: int = BUFFER_ROWS,
        application_name: str = "outbox-wal-source",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.buffer_rows = buffer_rows
        self.reader = WalReader(
            url, spec, position=position, heartbeat=heartbeat, application_name=application_name
        )
        self._conninfo = libpq_conninfo(url, f"{application_name}/lookup")
        self._clock = clock
        self._statements = WalStatements(spec)
        self._lookup: psycopg.Connection[Any] | None = None
        #: Rows taken in and not handed out, per shard, in commit order.
        self._queues: dict[int, deque[_Entry]] = {}
        self._queued = 0
        #: Rows waiting aside (a retry recorded), per shard, in seq order; and their keys.
        self._aside: dict[int, list[_Entry]] = {}
        self._held: dict[int, dict[tuple[str, bytes], int]] = {}
        #: Rows handed out and not settled: by id, and per shard as the last read gave them.
        self._out: dict[uuid.UUID, _Entry] = {}
        self._handed: dict[int, list[_Entry]] = {}
        #: The stream's transactions not yet passed by the settled position, oldest first.
        self._spans: deque[_Span] = deque()
        self._open: _Span | None = None
        self._position = 0
        #: Snapshots for the horizon, oldest first: (WAL position, oldest running xid).
        self._samples: deque[tuple[int, int]] = deque()
        self._sampled_at = float("-inf")
        #: Transactions committed before this position may have been settled before a restart.
        self._replay_until = 0
        self._index = 0
        self._kept_alive_at = float("-inf")
        self._recorded_horizon = horizon

    # -- the calls a relay makes --------------------------------------------------------------

    def start(self) -> int:
        """Start streaming (the reader's checks and one-line errors), read the rows waiting
        aside, and take the first snapshot. Returns the position streamed from."""
        try:
            self._lookup = psycopg.connect(self._conninfo, autocommit=True)
            start = self.reader.start()
            # Taken once this source holds the slot, whose last reader is gone: a transaction
            # committed after this position was handed out by nobody before.
            sample = self._sample()
        except BaseException:
            self.close()
            raise
        self._position = start
        self._replay_until = sample[0]
        if self._recorded_horizon is not None:
            self._samples.append((start, self._recorded_horizon))
        self._samples.append(sample)
        self._sampled_at = self._clock()
        self._load_aside()
        return start

    def read(self, read: Read, owned: Sequence[int] = ()) -> list[PendingRow]:
        """The next rows of ``read.shards`` that may go now, at most ``read.size`` in all and
        ``read.per_shard`` of one shard, in commit order: first those of a shard handed out
        before and not settled, then its retries that are due, then what came since."""
        self.take_in()
        now = self._clock()
        chosen: list[tuple[int, list[_Entry]]] = []
        for shard in read.shards:
            self._take_back(shard)
            entries = self._due_aside(shard, now, read.per_shard)
            entries += self._next_queued(shard, read.per_shard - len(entries))
            chosen.append((shard, entries))
        # The whole read in commit order; what the size leaves out goes back to its shard.
        ordered = sorted((e for _, entries in chosen for e in entries), key=_stream_index)
        taken = {id(e) for e in ordered[: read.size]}
        rows: list[PendingRow] = []
        for shard, entries in chosen:
            handed = [e for e in entries if id(e) in taken]
            left = [e for e in entries if id(e) not in taken and e.due is None]
            self._queues.setdefault(shard, deque()).extendleft(reversed(left))
            self._queued += len(left)
            self._handed[shard] = handed
            for entry in handed:
                self._out[entry.row.id] = entry
        for entry in ordered[: read.size]:
            rows.append(entry.row)
        return rows

    def take_in(self, timeout: float = 0.0) -> bool:
        """Take in what the stream has, waiting up to ``timeout`` seconds when it has nothing;
        returns whether rows came. With :data:`BUFFER_ROWS` held, it reads nothing and keeps
        the stream alive instead. Call it at least every few seconds, also while every shard
        is busy (the server ends a stream not heard from for ``wal_sender_timeout``)."""
        self._sample_if_due()
        room = self.buffer_rows - self._queued
        if room <= 0:
            now = self._clock()
            if now - self._kept_alive_at >= KEEP_ALIVE_SECONDS:
                self._kept_alive_at = now
                self.reader.keep_alive()
            return False
        items = self.reader.read(min(room, PULL_ITEMS), timeout)
        return self._take(items) if items else False

    def sleep(self, timeout: float) -> bool:
        """Nothing to do: wait up to ``timeout`` for rows; returns whether rows came."""
        return self.take_in(timeout)

    def recorded(self, event: Recorded) -> None:
        """The outcome of rows handed out is recorded (the ``Recorded`` the core is given): each
        row is settled, but those ``held`` (not recorded yet, tried again). A retry waits aside
        until it is due, holding its key; a row sent or dead lets its key go on."""
        recording, held = event.recording, event.held
        for ack in recording.acks:
            entry = self._out.pop(ack.id, None)
            if entry is not None:
                self._settle(entry)
                self._leave_aside(entry)
        for failure in recording.failures:
            if failure.id in held:
                continue
            entry = self._out.pop(failure.id, None)
            if entry is None:
                continue
            self._settle(entry)
            if failure.delay is None:
                self._leave_aside(entry)
                continue
            row = entry.row
            entry.row = PendingRow(
                row.id, row.shard, row.attempts + 1, row.created_at, row.record, row.problem
            )
            if entry.due is None:
                self._set_aside(entry)
            entry.due = self._clock() + failure.delay

    def settled(self) -> Settled:
        """The settled position, and the horizon that goes with it."""
        spans = self._spans
        while spans and spans[0].waiting == 0:
            end = spans[0].end
            if end is None:
                break  # its Commit has not come yet
            spans.popleft()
            self._position = end
        samples = self._samples
        while len(samples) > 1 and samples[1][0] <= self._position:
            samples.popleft()
        horizon = samples[0][1] if samples and samples[0][0] <= self._position else None
        return Settled(self._position, horizon)

    def confirm(self, position: int) -> None:
        """Let the slot move to ``position`` (from :meth:`settled`, recorded durably first);
        sent to the server at the next :meth:`take_in`."""
        if position > self._position:
            raise ValueError("cannot confirm past the settled position")
        self.reader.confirm(position)

    @property
    def buffered(self) -> int:
        """Rows taken in from the stream and not handed out yet."""
        return self._queued

    def close(self) -> None:
        """End the stream (a confirmed position not sent yet is sent first)."""
        self.reader.close()
        if self._lookup is not None:
            self._lookup.close()
            self._lookup = None

    def __enter__(self) -> WalSource:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- taking in ------------------------------------------------------------------------------

    def _take(self, items: Iterable[Item]) -> bool:
        """Queue the stream's rows by shard; open and close their transactions' spans."""
        came: list[_Entry] = []
        replayed: list[_Entry] = []
        for item in items:
            if type(item) is WalMessage:
                span = self._open
                if span is None:  # (the reader hands rows out only within a transaction)
                    span = self._open = _Span(None)
                    self._spans.append(span)
                row = pending_row_of_message(item)
                self._index += 1
                entry = _Entry(row, self._index, span, _key_of(row))
                came.append(entry)
                if item.commit_lsn < self._replay_until:
                    replayed.append(entry)
                span.waiting += 1
            elif type(item) is Begin:
                self._open = _Span(None)
                self._spans.append(self._open)
            elif type(item) is Commit:
                if self._open is not None:
                    self._open.end = item.end_lsn
                self._open = None
            elif type(item) is Heartbeat:
                self._spans.append(_Span(item.lsn))
        if replayed:
            fresh = self._fresh({e.row.id for e in replayed})
            stale = {id(e) for e in replayed if e.row.id not in fresh}
            for entry in replayed:
                if id(entry) in stale:
                    self._settle(entry)  # its outcome is in the table already
            came = [e for e in came if id(e) not in stale]
        for entry in came:
            self._queues.setdefault(entry.row.shard, deque()).append(entry)
        self._queued += len(came)
        return bool(came)

    def _fresh(self, ids: set[uuid.UUID]) -> set[uuid.UUID]:
        """Of rows handed out again after a restart, those the table says may go as new: not
        dead or sent, not waiting aside (read at start), not gone."""
        found = self._require_lookup().execute(self._statements["wal_replayed"], {"ids": list(ids)})
        return {row[0] for row in found}

    def _load_aside(self) -> None:
        """The rows waiting aside after a failure, from the table: they hold their keys."""
        now = self._clock()
        for values in self._require_lookup().execute(self._statements["wal_aside"]):
            row = pending_row_of(values[:-1])
            self._index += 1
            entry = _Entry(row, self._index, None, _key_of(row), now + float(values[-1]))
            self._set_aside(entry)

    # -- handing out ----------------------------------------------------------------------------

    def _take_back(self, shard: int) -> None:
        """The shard is idle: what of it was handed out and not settled came back."""
        back = [e for e in self._handed.pop(shard, ()) if self._out.pop(e.row.id, None)]
        queued = [e for e in back if e.due is None]
        if queued:
            self._queues.setdefault(shard, deque()).extendleft(reversed(queued))
            self._queued += len(queued)

    def _due_aside(self, shard: int, now: float, limit: int) -> list[_Entry]:
        """The first waiting row of each key held aside in ``shard``, if it is due."""
        due: list[_Entry] = []
        seen: set[tuple[str, bytes]] = set()
        for entry in self._aside.get(shard, ()):
            if len(due) >= limit:
                break
            key = entry.key
            if key is not None:
                if key in seen:
                    continue
                seen.add(key)
            if entry.due is not None and entry.due <= now:
                due.append(entry)
        return due

    def _next_queued(self, shard: int, limit: int) -> list[_Entry]:
        """Up to ``limit`` of the shard's queued rows, in order, passing over held keys."""
        queue = self._queues.get(shard)
        if not queue or limit <= 0:
            return []
        held = self._held.get(shard)
        taken: list[_Entry] = []
        passed: list[_Entry] = []
        while queue and len(taken) < limit:
            entry = queue.popleft()
            if held and entry.key in held:
                passed.append(entry)
            else:
                taken.append(entry)
        queue.extendleft(reversed(passed))
        self._queued -= len(taken)
        return taken

    # -- settling -------------------------------------------------------------------------------

    def _settle(self, entry: _Entry) -> None:
        span, entry.span = entry.span, None
        if span is not None:
            span.waiting -= 1

    def _set_aside(self, entry: _Entry) -> None:
        shard = entry.row.shard
        aside = self._aside.setdefault(shard, [])
        aside.append(entry)
        aside.sort(key=_seq_of)
        if entry.key is not None:
            held = self._held.setdefault(shard, {})
            held[entry.key] = held.get(entry.key, 0) + 1

    def _leave_aside(self, entry: _Entry) -> None:
        if entry.due is None:
            return
        entry.due = None
        shard = entry.row.shard
        self._aside[shard].remove(entry)
        if entry.key is not None:
            held = self._held[shard]
            held[entry.key] -= 1
            if not held[entry.key]:
                del held[entry.key]

    # -- the horizon ----------------------------------------------------------------------------

    def _sample_if_due(self) -> None:
        now = self._clock()
        if now - self._sampled_at >= HORIZON_SECONDS:
            self._sampled_at = now
            self._samples.append(self._sample())

    def _sample(self) -> tuple[int, int]:
        """A WAL position and the oldest transaction running in a snapshot taken before it."""
        row = self._require_lookup().execute(self._statements["wal_horizon"]).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def _require_lookup(self) -> psycopg.Connection[Any]:
        if self._lookup is None:
            raise RuntimeError("the WAL source has not started")
        return self._lookup


if TYPE_CHECKING:

    def _a_source(source: WalSource) -> Source:
        return source  # mypy checks that WalSource is what the driver reads from


def _stream_index(entry: _Entry) -> int:
    return entry.index


def _seq_of(entry: _Entry) -> int:
    record = entry.row.record
    return record.seq if record is not None else 0
