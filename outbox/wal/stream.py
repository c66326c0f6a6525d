"""One replication connection streaming a logical slot (``START_REPLICATION ... LOGICAL``).

psycopg 3 has no replication API, but its libpq binding (``psycopg.pq``, public, with a C
implementation in psycopg-binary) speaks the protocol's COPY BOTH mode: the server pushes
each decoded change as a CopyData message and we answer with standby status updates. That
is all a logical reader needs, so the WAL source takes no second PostgreSQL driver:
``bench/wal_probe.py`` measures this stream beside psycopg2's replication connection.

Messages from the server (PostgreSQL's "Streaming Replication Protocol"):

    'w' XLogData:  start LSN, WAL end, send time (three int64), then one pgoutput message
    'k' keepalive: WAL end, send time (int64 each), reply requested (byte)

and to it, the standby status update: 'r', written, flushed, applied LSNs, clock, reply
requested. The slot keeps everything from its ``confirmed_flush_lsn`` on: the flushed
position we send is what moves it.
"""

from __future__ import annotations

import select
import struct
import time

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo

from outbox.wal.errors import WalError
from outbox.wal.lsn import format_lsn

XLOG_DATA = ord("w")
KEEPALIVE = ord("k")
#: Bytes before the pgoutput message in an XLogData message.
XLOG_HEADER = 25

_STATUS = struct.Struct(">cQQQqB")
_KEEPALIVE = struct.Struct(">QqB")
_PG_EPOCH = 946_684_800


class StreamError(WalError):
    """The replication connection failed or the server ended the stream; ``sqlstate`` and
    the server's text say why (the reader looks at the slot to tell a lost slot apart)."""

    def __init__(self, text: str, sqlstate: str | None = None) -> None:
        super().__init__(text)
        self.sqlstate = sqlstate


class ReplicationStream:
    """A replication connection (``replication=database``) to one database; ``conninfo``
    as libpq takes it (``key=value`` pairs or a ``postgresql://`` URL)."""

    def __init__(self, conninfo: str) -> None:
        params = make_conninfo(conninfo, replication="database")
        self._conn = pq.PGconn.connect(params.encode())
        if self._conn.status != pq.ConnStatus.OK:
            text = _text(self._conn.error_message)
            self._conn.finish()
            raise StreamError(text)
        #: The newest WAL end the server told us of (keepalives and XLogData headers).
        self.server_wal_end = 0

    def start(self, slot: str, start: int, options: dict[str, str]) -> None:
        """Stream ``slot`` from ``start`` (the server starts at the slot's confirmed position
        if that is later: the reader checks for that before it starts)."""
        listed = ", ".join(f"\"{name}\" '{value}'" for name, value in options.items())
        command = f'START_REPLICATION SLOT "{slot}" LOGICAL {format_lsn(start)} ({listed})'
        try:
            self._conn.send_query(command.encode())
            result = self._conn.get_result()
        except psycopg.OperationalError as error:
            raise _failed(error) from error
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            raise _error_of(result, self._conn)
        self._conn.nonblocking = 1

    def read(self, max_items: int, timeout: float) -> list[bytes]:
        """Up to ``max_items`` raw messages ('w' and 'k', in the order sent); waits up to
        ``timeout`` seconds for the first, none for the rest. A connection that fails
        (closed by the server, say after ``wal_sender_timeout``) raises StreamError."""
        try:
            return self._read(max_items, timeout)
        except psycopg.OperationalError as error:  # libpq's own failures (psycopg.pq raises)
            raise _failed(error) from error

    def _read(self, max_items: int, timeout: float) -> list[bytes]:
        conn = self._conn
        items: list[bytes] = []
        append = items.append
        deadline = 0.0
        while len(items) < max_items:
            size, buffer = conn.get_copy_data(1)
            if size > 0:
                append(bytes(buffer))
                continue
            if size == 0:
                conn.consume_input()
                size, buffer = conn.get_copy_data(1)
                if size > 0:
                    append(bytes(buffer))
                    continue
                if size == 0:
                    if items:
                        break
                    if not deadline:
                        deadline = time.monotonic() + timeout
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    select.select([conn.socket], [], [], left)
                    conn.consume_input()
                    continue
            # -1: the server ended the copy (an error follows); -2 (the connection failed) is
            # raised by psycopg as OperationalError: see read
            raise _error_of(conn.get_result() if size == -1 else None, conn)
        for item in items:
            if item[0] == KEEPALIVE:
                (end, _sent, _reply) = _KEEPALIVE.unpack_from(item, 1)
                self.server_wal_end = max(self.server_wal_end, end)
        return items

    def send_status(self, flushed: int, *, reply: bool = False) -> None:
        """Tell the server everything before ``flushed`` is done with (the slot may move
        there); ``reply`` asks for a keepalive back, carrying the server's WAL end."""
        clock = int((time.time() - _PG_EPOCH) * 1_000_000)
        message = _STATUS.pack(b"r", flushed, flushed, flushed, clock, 1 if reply else 0)
        try:
            if self._conn.put_copy_data(message) != 1:
                raise _error_of(None, self._conn)
            while self._conn.flush() == 1:
                select.select([], [self._conn.socket], [], 1.0)
        except psycopg.OperationalError as error:
            raise _failed(error) from error

    def close(self) -> None:
        self._conn.finish()

    @property
    def backend_pid(self) -> int:
        return self._conn.backend_pid


def keepalive_end(item: bytes) -> tuple[int, bool]:
    """A keepalive's WAL end and whether the server asked for a reply."""
    end, _sent, reply = _KEEPALIVE.unpack_from(item, 1)
    return end, bool(reply)


def _error_of(result: pq.abc.PGresult | None, conn: pq.abc.PGconn) -> StreamError:
    if result is not None and result.error_message:
        state = result.error_field(pq.DiagnosticField.SQLSTATE)
        return StreamError(_text(result.error_message), state.decode() if state else None)
    return StreamError(_text(conn.error_message) or "the replication connection was lost")


def _failed(error: psycopg.OperationalError) -> StreamError:
    """What psycopg's libpq binding raises for a failed connection, as one line."""
    return StreamError(" ".join(str(error).split()))


def _text(message: bytes) -> str:
    return message.decode(errors="replace").strip().replace("\n", " ")
