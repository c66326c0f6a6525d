"""The WAL reader: the outbox's committed messages from its slot, in commit order.

A relay drives it with three calls::

    reader = WalReader(url, spec, position=recorded)   # recorded: the last position it kept
    reader.start()
    while running:
        for item in reader.read(10_000, timeout=1.0):
            ...   # Begin, WalMessage, Commit, Heartbeat, in the order committed
        reader.confirm(end)   # once Kafka acknowledged everything up to a Commit/Heartbeat

What it does and what it leaves to the caller:

- **Commit order, transactions kept.** Every message of a transaction comes between its
  :class:`Begin` and :class:`Commit`, and carries the commit's position. A transaction is
  done with only as a whole: the positions to confirm are a :class:`Commit`'s ``end_lsn``
  (and a :class:`Heartbeat`'s ``lsn``), and after a restart the slot hands out again every
  transaction whose end was not confirmed.
- **Confirmed only when told.** The slot moves to what :meth:`WalReader.confirm` was given,
  never further: the caller confirms after Kafka acknowledged (exactly-once: after the Kafka
  transaction that records the position committed), and records the position durably
  *before* it confirms it, so that the slot is never ahead of the record.
- **Heartbeats.** While the outbox is idle and other tables are busy, the slot still holds
  the WAL they write until it is told it may move. Every ``heartbeat`` seconds the reader asks
  the server where its decoding stands and hands the answer out as a :class:`Heartbeat`
  ("nothing for the outbox up to here"), in its place in the stream; the caller records and
  confirms it like a commit. Bound: the slot holds the WAL of about one heartbeat interval
  plus what is written until PostgreSQL's next running-transactions record (the background
  writer logs one every 15 s while the server is busy, and each checkpoint logs one), on top
  of what the caller has not confirmed yet.
- **A lost slot is said at once.** At start and whenever the stream fails, the slot is looked
  at: gone, invalidated (``wal_status = 'lost'``), or starting after the caller's position (a
  slot made again under the same name, or a promoted standby's), each raises
  :class:`~outbox.wal.errors.SlotLost`. The caller recovers from the outbox table, where every
  message committed meanwhile still is. Any other failure of the stream raises
  :class:`~outbox.wal.stream.StreamError`: reconnect with a new reader from the recorded
  position.
"""

from __future__ import annotations

import contextlib
import struct
import time
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.conninfo import make_conninfo

from outbox.schema import DEFAULT_SPEC, OutboxTableSpec
from outbox.wal.checks import check_server
from outbox.wal.errors import SlotLost, WalError
from outbox.wal.lsn import format_lsn
from outbox.wal.pgoutput import INSERT, Begin, Commit, PgOutputDecoder, WalMessage
from outbox.wal.slots import (
    PLUGIN,
    SlotState,
    create_slot,
    ensure_publication,
    slot_name,
    slot_state,
    stream_options,
)
from outbox.wal.stream import (
    XLOG_DATA,
    XLOG_HEADER,
    ReplicationStream,
    StreamError,
    keepalive_end,
)

#: Seconds between heartbeats. Also how often the slot is looked at (one small query) and its
#: held-back WAL measured: short enough for an alert to see a growing backlog within a scrape
#: or two, long enough to cost nothing.
HEARTBEAT_SECONDS = 10.0

_XLOG_START = struct.Struct(">Q").unpack_from


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Nothing for the outbox was committed before ``lsn`` that the stream has not handed out:
    once everything before it is acknowledged, confirming ``lsn`` lets the slot move there."""

    lsn: int


Item = Begin | WalMessage | Commit | Heartbeat


class WalReader:
    """Reads one outbox table's messages from its replication slot (see the module's text).

    ``url``: the database (a SQLAlchemy URL, psycopg 3, as every outbox URL); the role needs
    the ``REPLICATION`` attribute. ``position``: the last position the caller recorded
    (None on its very first start: the slot is then made, or taken as it stands).
    ``heartbeat``: seconds between heartbeats (None: none, for tests of their absence).
    ``slot``: the slot's name, when not the one named after the table.
    """

    def __init__(
        self,
        url: str | sa.URL,
        spec: OutboxTableSpec = DEFAULT_SPEC,
        *,
        position: int | None = None,
        heartbeat: float | None = HEARTBEAT_SECONDS,
        application_name: str = "outbox-wal-reader",
        slot: str | None = None,
    ) -> None:
        self.spec = spec
        self.slot = slot or slot_name(spec)
        self._conninfo = libpq_conninfo(url, application_name)
        self._recorded = position
        self._heartbeat = heartbeat
        self._decoder = PgOutputDecoder((spec.schema, spec.table))
        self._control: psycopg.Connection[Any] | None = None
        self._stream: ReplicationStream | None = None
        self._confirmed = 0
        self._sent = -1
        #: The end of the last transaction (or heartbeat) handed out.
        self._handed_out = 0
        self._in_transaction = False
        self._next_heartbeat = 0.0
        self._asked_at = 0.0
        #: What the last look at the slot found (for ``outbox status`` and the metrics).
        self.last_state: SlotState | None = None

    # -- the calls a relay makes --------------------------------------------------------------

    def start(self) -> int:
        """Check the server, make the publication and (on a first start) the slot, check the
        slot still covers the recorded position, and start streaming. Returns the position
        the stream starts from. Raises the one-line errors of :mod:`outbox.wal.errors`."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> int:
        self._control = control = psycopg.connect(self._conninfo, autocommit=True)
        check_server(control, self.slot)
        ensure_publication(control, self.spec)
        state = slot_state(control, self.slot)
        if state is None:
            if self._recorded is not None:
                raise self._lost("missing", f"replication slot {self.slot} does not exist")
            start = create_slot(control, self.slot)
        else:
            self._verify(state)
            start = state.confirmed_flush_lsn or 0
            if self._recorded is not None:
                start = self._recorded
        self._confirmed = self._handed_out = start
        self._stream = ReplicationStream(self._conninfo)
        try:
            self._stream.start(self.slot, start, stream_options(self.spec))
        except StreamError as error:
            raise self._explain(error) from error
        self._next_heartbeat = time.monotonic() + (self._heartbeat or 0)
        return start

    def read(self, max_items: int = 10_000, timeout: float = 1.0) -> list[Item]:
        """The next items in commit order (up to ``max_items`` raw messages' worth); waits up
        to ``timeout`` seconds when there is nothing yet. Also sends the confirmed position
        and the heartbeat when they are due, and answers the server's keepalives: call it (or
        :meth:`keep_alive`) at least every ``wal_sender_timeout`` / 2 (30 s by default), or
        the server ends the stream."""
        stream = self._require_stream()
        self._send_confirmed()
        try:
            raw = stream.read(max_items, timeout)
        except StreamError as error:
            raise self._explain(error) from error
        items: list[Item] = []
        append = items.append
        decode = self._decoder.decode
        insert = self._decoder.decode_insert
        for message in raw:
            if message[0] == XLOG_DATA:
                if message[XLOG_HEADER] == INSERT:  # the hot path: one call, no dispatch
                    append(insert(message, XLOG_HEADER, _XLOG_START(message, 1)[0]))
                    continue
                item = decode(message, XLOG_HEADER, _XLOG_START(message, 1)[0])
                if type(item) is Commit:
                    self._in_transaction = False
                    self._handed_out = item.end_lsn
                    append(item)
                elif type(item) is Begin:
                    self._in_transaction = True
                    append(item)
            else:
                end, reply = keepalive_end(message)
                if self._asked_at and not self._in_transaction and end > self._handed_out:
                    # The answer to our heartbeat: the server decoded up to ``end`` and the
                    # stream held nothing for the outbox before it.
                    self._asked_at = 0.0
                    self._handed_out = end
                    items.append(Heartbeat(end))
                if reply:
                    self._send_status(self._confirmed)
        if self._heartbeat is not None and time.monotonic() >= self._next_heartbeat:
            self._beat()
        return items

    def confirm(self, lsn: int) -> None:
        """Kafka acknowledged (and the caller recorded) everything up to ``lsn``, a
        :class:`Commit`'s ``end_lsn`` or a :class:`Heartbeat`'s ``lsn``: the slot may release
        the WAL before it. Sent to the server on the next :meth:`read` (or :meth:`flush`)."""
        if lsn > self._handed_out:
            raise ValueError(
                f"cannot confirm {format_lsn(lsn)}: the reader handed out only up to "
                f"{format_lsn(self._handed_out)}"
            )
        self._confirmed = max(self._confirmed, lsn)

    def flush(self) -> None:
        """Send the confirmed position now (before a clean stop)."""
        self._require_stream()
        self._send_confirmed()

    def keep_alive(self) -> None:
        """Tell the server this reader is there without taking anything from the stream (a
        relay that holds all it may, behind a slow Kafka): the server ends a stream it has
        heard nothing from for ``wal_sender_timeout``, read or not. Sends the confirmed
        position."""
        self._send_status(self._confirmed)

    @property
    def confirmed(self) -> int:
        """The position last confirmed (or started from)."""
        return self._confirmed

    def held_back(self) -> int | None:
        """Bytes of WAL the slot holds back now (None: no slot)."""
        state = self.look()
        return None if state is None else state.held_bytes

    def look(self) -> SlotState | None:
        """The slot as the server shows it now (raises :class:`SlotLost` when it is lost)."""
        if self._control is None:
            raise WalError("the reader has not started")
        self.last_state = state = slot_state(self._control, self.slot)
        if state is None:
            raise self._lost("dropped", f"replication slot {self.slot} was dropped")
        self._verify(state)
        return state

    def close(self) -> None:
        """End the stream (what was confirmed and not yet sent is sent first)."""
        if self._stream is not None:
            # A stream gone already has nothing to send to: the next reader starts from the
            # recorded position.
            with contextlib.suppress(StreamError):
                self._send_confirmed()
            self._stream.close()
            self._stream = None
        if self._control is not None:
            self._control.close()
            self._control = None

    def __enter__(self) -> WalReader:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _require_stream(self) -> ReplicationStream:
        if self._stream is None:
            raise WalError("the reader has not started (or was closed)")
        return self._stream

    def _send_confirmed(self) -> None:
        if self._confirmed != self._sent:
            self._send_status(self._confirmed)

    def _send_status(self, flushed: int, reply: bool = False) -> None:
        try:
            self._require_stream().send_status(flushed, reply=reply)
        except StreamError as error:
            raise self._explain(error) from error
        self._sent = flushed

    def _beat(self) -> None:
        """Ask the server where its decoding stands (its keepalive answer becomes a
        Heartbeat item), and look at the slot."""
        self._next_heartbeat = time.monotonic() + (self._heartbeat or 0)
        self._asked_at = time.monotonic()
        self._send_status(self._confirmed, reply=True)
        self.look()

    def _verify(self, state: SlotState) -> None:
        """Raise SlotLost when ``state`` cannot hand out what followed the recorded position."""
        if state.wal_status == "lost":
            raise self._lost(
                "invalidated",
                f"replication slot {self.slot} was invalidated (max_slot_wal_keep_size): the "
                "WAL it needed is gone",
            )
        if state.plugin != PLUGIN:
            raise self._lost(
                "recreated",
                f"replication slot {self.slot} decodes with {state.plugin}, not "
                f"{PLUGIN}: it is not the outbox's",
            )
        floor = self._recorded if self._sent < 0 else self._sent
        confirmed = state.confirmed_flush_lsn or 0
        if floor is not None and confirmed > floor:
            raise self._lost(
                "recreated",
                f"replication slot {self.slot} starts at {format_lsn(confirmed)}, after the "
                f"position recorded ({format_lsn(floor)}): it was made again, or moved by "
                "another reader",
            )

    def _explain(self, error: StreamError) -> WalError:
        """A failed stream: SlotLost when the slot is the reason, else the error itself."""
        if self._control is None or self._control.closed:
            return error
        try:
            state = slot_state(self._control, self.slot)
        except psycopg.Error:
            return error  # the server itself is out of reach: not a verdict on the slot
        if state is None:
            return self._lost("dropped", f"replication slot {self.slot} was dropped ({error})")
        try:
            self._verify(state)
        except SlotLost as lost:
            return lost
        return error

    def _lost(self, reason: str, text: str) -> SlotLost:
        position = self._recorded if self._sent < 0 else self._confirmed
        where = "none recorded" if position is None else f"last confirmed {format_lsn(position)}"
        return SlotLost(
            f"{text}; {where}: recover from the outbox table",
            slot=self.slot,
            reason=reason,
            position=position,
        )


def libpq_conninfo(url: str | sa.URL, application_name: str) -> str:
    """``url`` (SQLAlchemy) as libpq's ``key=value`` string, with TCP keepalives: a reader
    on a dead connection learns of it within seconds, not when the kernel gives up."""
    parsed = sa.make_url(url)
    params: dict[str, Any] = {
        "host": parsed.host or "localhost",
        "port": parsed.port or 5432,
        "user": parsed.username,
        "password": parsed.password,
        "dbname": parsed.database,
        "connect_timeout": 10,
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "application_name": application_name[:63],
    }
    return make_conninfo(**{k: v for k, v in params.items() if v is not None})
