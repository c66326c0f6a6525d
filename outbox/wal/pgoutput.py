"""Decoding ``pgoutput``'s messages into outbox messages, in Python, as cheaply as we can.

PostgreSQL's own output plugin sends each change as one small binary message (its format:
"Logical Replication Message Formats" in PostgreSQL's manual). The outbox's publication
(:mod:`outbox.wal.slots`) publishes the inserts of the outbox table, only the columns a relay
sends, in binary (``binary 'true'``): a uuid is its 16 bytes, a bytea its bytes, a timestamp
eight; nothing to parse from text. A relay reads every message through here, so the hot path
is one ``struct`` call for the fixed head of a row and straight-line code for the rest (no
loop over columns, no per-column objects): measured by ``bench/wal_probe.py``.

What comes out, in commit order: a :class:`Begin` at each transaction's start, a
:class:`WalMessage` per outbox row (carrying its own position and its transaction's commit
position), and a :class:`Commit` at the end. Everything else (Relation, Type, Origin, logical
messages of other prefixes) is taken in and answers None.
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass

from outbox.wal.errors import UnexpectedStream

#: The outbox table's columns the publication carries, in this order: what a relay needs to
#: build the Kafka record (id, topic, key, value, headers), keep order (seq, shard) and time
#: the message (created_at).
PUBLISHED_COLUMNS = (
    "id",
    "seq",
    "shard",
    "topic",
    "key",
    "value",
    "content_type",
    "header_names",
    "header_values",
    "created_at",
)

#: Microseconds from the Unix epoch to PostgreSQL's (2000-01-01 UTC).
_PG_EPOCH_US = 946_684_800_000_000

# Begin: final (commit) LSN, commit time, xid.
_BEGIN = struct.Struct(">QqI")
# Commit: flags, commit LSN, end LSN, commit time.
_COMMIT = struct.Struct(">BQQq")
# Insert: relation id, 'N', column count; then id (kind, length 16, bytes), seq (kind, 8,
# int8) and shard (kind, 2, int2), which are never NULL: one call for the fixed head.
_INSERT_HEAD = struct.Struct(">IcHcI16scIqcIh")
_INT32 = struct.Struct(">i")
_UINT32 = struct.Struct(">I")
_INT64 = struct.Struct(">q")
# Logical message: flags, LSN (the prefix and the content follow).
_MESSAGE = struct.Struct(">BQ")

_B, _C, _I, _R, _M = (ord(c) for c in "BCIRM")
#: The tag of an insert, the message a reader sees most: see :meth:`decode_insert`.
INSERT = _I
_NULL, _BINARY = ord("n"), ord("b")


# Not frozen: a frozen dataclass's __init__ costs three times a plain one's, and one is built
# per message read (as outbox.rows.PendingRow).
@dataclass(slots=True)
class WalMessage:
    """An outbox row as the WAL carried it, with where it stands in the WAL."""

    id: uuid.UUID
    seq: int
    shard: int
    topic: str
    key: bytes | None
    value: bytes | None
    content_type: str | None
    header_names: list[str | None] | None
    header_values: list[bytes | None] | None
    #: When the writing transaction inserted it (seconds since the Unix epoch).
    created_at: float
    #: The insert's own WAL position: with ``commit_lsn``, the message's place in the stream.
    lsn: int
    #: Its transaction's commit record: every message of one transaction shares it.
    commit_lsn: int


# Begin and Commit: not frozen either (one of each per transaction).
@dataclass(slots=True)
class Begin:
    """A transaction's start; ``commit_lsn`` is where its commit record is."""

    commit_lsn: int
    #: Seconds since the Unix epoch.
    commit_time: float
    xid: int


@dataclass(slots=True)
class Commit:
    """A transaction's end: confirming ``end_lsn`` tells the slot it is done with."""

    commit_lsn: int
    end_lsn: int
    #: Seconds since the Unix epoch.
    commit_time: float
    xid: int


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    """A ``pg_logical_emit_message`` message (transactional ones carry their commit LSN)."""

    prefix: str
    content: bytes
    lsn: int
    transactional: bool


class PgOutputDecoder:
    """Turns one slot's ``pgoutput`` messages into :class:`WalMessage` and :class:`Commit`.

    ``table`` is ``(schema, name)`` of the outbox table. Keeps the state the stream carries
    between messages: the open transaction and the relations announced.
    """

    def __init__(self, table: tuple[str, str], message_prefixes: frozenset[str] = frozenset()):
        self.table = table
        #: Logical messages with these prefixes come out as :class:`LogicalMessage`; others
        #: (heartbeats) are taken in silently.
        self.message_prefixes = message_prefixes
        self._outbox_relation: int | None = None
        self._other_relations: dict[int, str] = {}
        self._commit_lsn = 0
        self._xid = 0

    def decode(
        self, data: bytes, offset: int = 0, lsn: int = 0
    ) -> WalMessage | Begin | Commit | LogicalMessage | None:
        """Decode the message at ``data[offset:]``; ``lsn`` is the change's WAL position
        (the row's ``lsn`` column, or the XLogData header's start)."""
        tag = data[offset]
        if tag == _I:
            return self.decode_insert(data, offset, lsn)
        if tag == _B:
            self._commit_lsn, time, self._xid = _BEGIN.unpack_from(data, offset + 1)
            return Begin(self._commit_lsn, (time + _PG_EPOCH_US) / 1e6, self._xid)
        if tag == _C:
            _flags, commit_lsn, end_lsn, time = _COMMIT.unpack_from(data, offset + 1)
            return Commit(commit_lsn, end_lsn, (time + _PG_EPOCH_US) / 1e6, self._xid)
        if tag == _R:
            self._relation(data, offset)
            return None
        if tag == _M:
            return self._message(data, offset)
        return None  # Type, Origin: nothing an outbox needs; Update/Delete/Truncate: unpublished

    def decode_insert(self, data: bytes, offset: int, lsn: int) -> WalMessage:
        """:meth:`decode` for a message known to be an insert (tag :data:`INSERT`)."""
        (relation, _n, columns, _k, id_len, id_bytes, _k2, seq_len, seq, _k3, shard_len, shard) = (
            _INSERT_HEAD.unpack_from(data, offset + 1)
        )
        if relation != self._outbox_relation or columns != len(PUBLISHED_COLUMNS):
            name = self._other_relations.get(relation, f"relation {relation}")
            raise UnexpectedStream(
                f"an insert into {name} with {columns} columns: the publication should carry "
                f"the inserts of {self.table[0]}.{self.table[1]} only, "
                f"{len(PUBLISHED_COLUMNS)} columns"
            )
        if id_len != 16 or seq_len != 8 or shard_len != 2:
            raise UnexpectedStream("the publication does not send binary values (binary 'true')")
        pos = offset + 1 + _INSERT_HEAD.size
        i32 = _INT32.unpack_from
        # topic: text, never NULL
        (size,) = i32(data, pos + 1)
        pos += 5
        topic = data[pos : pos + size].decode()
        pos += size
        # key, value: bytea or NULL
        if data[pos] == _NULL:
            key = None
            pos += 1
        else:
            (size,) = i32(data, pos + 1)
            pos += 5
            key = data[pos : pos + size]
            pos += size
        if data[pos] == _NULL:
            value = None
            pos += 1
        else:
            (size,) = i32(data, pos + 1)
            pos += 5
            value = data[pos : pos + size]
            pos += size
        # content_type: text or NULL
        if data[pos] == _NULL:
            content_type = None
            pos += 1
        else:
            (size,) = i32(data, pos + 1)
            pos += 5
            content_type = data[pos : pos + size].decode()
            pos += size
        # header_names text[], header_values bytea[]: NULL (the usual case) or arrays
        names: list[str | None] | None = None
        header_values: list[bytes | None] | None = None
        if data[pos] == _NULL:
            pos += 1
        else:
            (size,) = i32(data, pos + 1)
            raw = _array(data, pos + 5, size)
            names = [None if v is None else v.decode() for v in raw]
            pos += 5 + size
        if data[pos] == _NULL:
            pos += 1
        else:
            (size,) = i32(data, pos + 1)
            header_values = _array(data, pos + 5, size)
            pos += 5 + size
        # created_at: timestamptz, never NULL
        (micros,) = _INT64.unpack_from(data, pos + 5)
        return WalMessage(
            uuid_of(id_bytes),
            seq,
            shard,
            topic,
            key,
            value,
            content_type,
            names,
            header_values,
            (micros + _PG_EPOCH_US) / 1e6,
            lsn,
            self._commit_lsn,
        )

    def _relation(self, data: bytes, offset: int) -> None:
        (relation,) = _UINT32.unpack_from(data, offset + 1)
        pos = offset + 5
        schema, pos = _string(data, pos)
        name, pos = _string(data, pos)
        pos += 1  # replica identity setting
        (count,) = struct.unpack_from(">h", data, pos)
        pos += 2
        columns = []
        for _ in range(count):
            column, pos = _string(data, pos + 1)  # flags, then the name
            columns.append(column)
            pos += 8  # type oid, type modifier
        if (schema, name) != self.table:
            # A partition of a partitioned outbox table is announced beside the table (whose
            # id its inserts carry, publish_via_partition_root); an insert into any other
            # relation is refused in _insert.
            self._other_relations[relation] = f"{schema}.{name}"
            return
        if tuple(columns) != PUBLISHED_COLUMNS:
            raise UnexpectedStream(
                f"the publication carries columns {', '.join(columns)} of "
                f"{schema}.{name}; expected {', '.join(PUBLISHED_COLUMNS)}"
            )
        self._outbox_relation = relation

    def _message(self, data: bytes, offset: int) -> LogicalMessage | None:
        flags, lsn = _MESSAGE.unpack_from(data, offset + 1)
        prefix, pos = _string(data, offset + 1 + _MESSAGE.size)
        if prefix not in self.message_prefixes:
            return None
        (size,) = _UINT32.unpack_from(data, pos)
        content = bytes(data[pos + 4 : pos + 4 + size])
        return LogicalMessage(prefix, content, lsn, bool(flags & 1))


_new = object.__new__
_set = object.__setattr__
_from_bytes = int.from_bytes
_UUID = uuid.UUID
_UNKNOWN = uuid.SafeUUID.unknown


def uuid_of(raw: bytes) -> uuid.UUID:
    """``uuid.UUID(bytes=raw)`` for 16 bytes at half its cost (it was a third of a row's
    decoding): what its ``__init__`` ends with, without the checks of its other forms."""
    value = _new(_UUID)
    _set(value, "int", _from_bytes(raw))
    _set(value, "is_safe", _UNKNOWN)
    return value


def _string(data: bytes, pos: int) -> tuple[str, int]:
    """A NUL-terminated string at ``pos``, and the position after it."""
    end = data.index(0, pos)
    return data[pos:end].decode(), end + 1


def _array(data: bytes, pos: int, size: int) -> list[bytes | None]:
    """A one-dimensional array in PostgreSQL's binary format: its elements' raw bytes."""
    ndim, _has_null, _element_type = struct.unpack_from(">iiI", data, pos)
    if ndim == 0:
        return []
    if ndim != 1:
        raise UnexpectedStream(f"a header array of {ndim} dimensions")
    (count, _lower) = struct.unpack_from(">ii", data, pos + 12)
    pos += 20
    elements: list[bytes | None] = []
    for _ in range(count):
        (length,) = _INT32.unpack_from(data, pos)
        pos += 4
        if length < 0:
            elements.append(None)
        else:
            elements.append(data[pos : pos + length])
            pos += length
    return elements
