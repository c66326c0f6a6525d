"""The pgoutput decoder on messages built by hand from the protocol's documented format (the
integration tests decode what a real server sends)."""

from __future__ import annotations

import struct
import uuid

import pytest

from outbox.wal.errors import UnexpectedStream
from outbox.wal.lsn import format_lsn, parse_lsn
from outbox.wal.pgoutput import (
    PUBLISHED_COLUMNS,
    Begin,
    Commit,
    LogicalMessage,
    PgOutputDecoder,
    WalMessage,
    uuid_of,
)

RELATION = 16_401
PG_EPOCH = 946_684_800


def text(value: str) -> bytes:
    return value.encode() + b"\0"


def relation(schema: str = "public", table: str = "outbox", columns=PUBLISHED_COLUMNS) -> bytes:
    body = struct.pack(">I", RELATION) + text(schema) + text(table) + b"d"
    body += struct.pack(">h", len(columns))
    for name in columns:
        body += b"\0" + text(name) + struct.pack(">Ii", 25, -1)
    return b"R" + body


def binary(value: bytes | None) -> bytes:
    return b"n" if value is None else b"b" + struct.pack(">i", len(value)) + value


def array(elements: list[bytes | None], element_type: int) -> bytes:
    has_null = int(any(e is None for e in elements))
    body = struct.pack(">iiIii", 1, has_null, element_type, len(elements), 1)
    for element in elements:
        body += struct.pack(">i", -1) if element is None else struct.pack(">i", len(element))
        body += element or b""
    return body


def insert(
    message_id: uuid.UUID,
    *,
    key: bytes | None = b"k",
    value: bytes | None = b"v",
    content_type: str | None = None,
    headers: list[tuple[str, bytes | None]] | None = None,
    created_us: int = 0,
) -> bytes:
    columns = [
        binary(message_id.bytes),
        binary(struct.pack(">q", 42)),
        binary(struct.pack(">h", 7)),
        binary(b"orders"),
        binary(key),
        binary(value),
        binary(None if content_type is None else content_type.encode()),
        binary(None if headers is None else array([n.encode() for n, _ in headers], 25)),
        binary(None if headers is None else array([v for _, v in headers], 17)),
        binary(struct.pack(">q", created_us)),
    ]
    return b"I" + struct.pack(">IcH", RELATION, b"N", len(columns)) + b"".join(columns)


def decoder() -> PgOutputDecoder:
    decoding = PgOutputDecoder(("public", "outbox"), frozenset({"outbox-probe"}))
    assert decoding.decode(relation()) is None
    return decoding


def test_a_transaction_decodes_to_begin_messages_and_commit() -> None:
    decoding = decoder()
    message_id = uuid.uuid4()
    begin = b"B" + struct.pack(">QqI", 0x1_0000_0200, 1_000_000, 733)
    commit = b"C" + struct.pack(">BQQq", 0, 0x1_0000_0200, 0x1_0000_0238, 1_000_000)

    first = decoding.decode(begin)
    row = decoding.decode(insert(message_id, created_us=2_500_000), 0, 0x1_0000_0100)
    last = decoding.decode(commit)

    assert first == Begin(0x1_0000_0200, PG_EPOCH + 1.0, 733)
    assert isinstance(row, WalMessage)
    assert (row.id, row.seq, row.shard, row.topic, row.key, row.value) == (
        message_id,
        42,
        7,
        "orders",
        b"k",
        b"v",
    )
    assert (row.content_type, row.header_names, row.header_values) == (None, None, None)
    assert row.created_at == PG_EPOCH + 2.5
    assert (row.lsn, row.commit_lsn) == (0x1_0000_0100, 0x1_0000_0200)
    assert last == Commit(0x1_0000_0200, 0x1_0000_0238, PG_EPOCH + 1.0, 733)


def test_nulls_headers_and_an_offset_into_the_buffer() -> None:
    decoding = decoder()
    headers = [("trace", b"\x00\x01"), ("empty", None)]
    message = insert(
        uuid.uuid4(), key=None, value=None, content_type="application/json", headers=headers
    )

    row = decoding.decode(b"\xff" * 25 + message, 25)

    assert isinstance(row, WalMessage)
    assert (row.key, row.value, row.content_type) == (None, None, "application/json")
    assert row.header_names == ["trace", "empty"]
    assert row.header_values == [b"\x00\x01", None]


def test_logical_messages_come_out_only_for_the_prefixes_asked_for() -> None:
    decoding = decoder()

    def message(prefix: str, content: bytes) -> bytes:
        head = b"M" + struct.pack(">BQ", 1, 0x500) + text(prefix)
        return head + struct.pack(">I", len(content)) + content

    assert decoding.decode(message("outbox-probe", b"\x01\x02")) == LogicalMessage(
        "outbox-probe", b"\x01\x02", 0x500, True
    )
    assert decoding.decode(message("someone-else", b"x")) is None


def test_a_publication_of_other_columns_is_refused() -> None:
    decoding = PgOutputDecoder(("public", "outbox"))
    with pytest.raises(UnexpectedStream, match="expected id, seq"):
        decoding.decode(relation(columns=("id", "seq", "shard")))


def test_an_insert_into_another_table_is_refused() -> None:
    decoding = PgOutputDecoder(("public", "outbox"))
    assert decoding.decode(relation(table="orders")) is None  # announced: a partition may be
    with pytest.raises(UnexpectedStream, match=r"an insert into public\.orders"):
        decoding.decode(insert(uuid.uuid4()))


def test_an_insert_before_its_relation_is_refused() -> None:
    decoding = PgOutputDecoder(("public", "outbox"))
    with pytest.raises(UnexpectedStream, match="insert into relation"):
        decoding.decode(insert(uuid.uuid4()))


def test_text_values_are_refused() -> None:
    decoding = decoder()
    message = bytearray(insert(uuid.uuid4()))
    struct.pack_into(">i", message, 9, 36)  # the id's length as text would give it
    with pytest.raises(UnexpectedStream, match="binary"):
        decoding.decode(bytes(message))


@pytest.mark.parametrize("text_form", ["0/0", "16/B374D848", "FFFFFFFF/FFFFFFFF"])
def test_lsn_text_round_trips(text_form: str) -> None:
    assert format_lsn(parse_lsn(text_form)) == text_form


def test_lsn_halves() -> None:
    assert parse_lsn("16/B374D848") == (0x16 << 32) | 0xB374D848
    with pytest.raises(ValueError, match="not an LSN"):
        parse_lsn("12345")


def test_uuid_of_makes_the_same_uuid_as_the_standard_way() -> None:
    import copy
    import pickle

    for _ in range(100):
        expected = uuid.uuid4()
        made = uuid_of(expected.bytes)
        assert made == expected and hash(made) == hash(expected)
        assert (str(made), made.bytes, made.version) == (
            str(expected),
            expected.bytes,
            expected.version,
        )
        assert pickle.loads(pickle.dumps(made)) == expected == copy.copy(made)
        with pytest.raises(TypeError, match="immutable"):
            made.int = 0  # type: ignore[misc]
