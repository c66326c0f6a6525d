import uuid
from typing import Any

import pytest

from outbox import ConfigError, Outbox
from outbox.errors import InvalidMessage, PayloadTooLarge, SerializationError
from outbox.message import CONTENT_TYPE_HEADER, Message, encode_message
from outbox.records import OutboxRecord
from outbox.schema import SHARD_COUNT, OutboxTableSpec, shard_of
from outbox.serialization import JsonSerializer


def encode(message: Message, limit: int = 1_000_000) -> Any:
    return encode_message(message, JsonSerializer(), limit)


def test_encoding_fills_the_row() -> None:
    encoded = encode(Message("orders", {"a": 1}, key="k", headers={"trace": "t"}))
    row = encoded.row
    assert row["id"] == encoded.id and encoded.id.version == 7
    assert row["value"] == b'{"a":1}'
    assert row["key"] == b"k"
    assert row["content_type"] == "application/json"
    assert row["header_names"] == ["trace"]
    assert row["header_values"] == [b"t"]
    assert row["shard"] == shard_of(b"k", encoded.id)


def test_content_type_follows_the_value() -> None:
    assert "content_type" not in encode(Message("orders", b"raw")).row
    assert encode(Message("orders", "text")).row["content_type"] == "text/plain; charset=utf-8"
    tombstone = encode(Message("orders", None, key="k")).row
    assert tombstone.keys() == {"id", "shard", "topic", "key"}  # NULL columns are left out


def test_ids_are_time_ordered() -> None:
    ids = [encode(Message("t", b"x")).id for _ in range(1000)]
    assert ids == sorted(ids)


def test_same_key_same_shard_and_shards_in_range() -> None:
    shards = {shard_of(b"customer-7", uuid.uuid4()) for _ in range(3)}
    assert len(shards) == 1
    spread = {shard_of(f"k{i}".encode(), uuid.uuid4()) for i in range(2000)}
    assert spread == set(range(SHARD_COUNT))


def test_size_limit_counts_key_value_and_headers() -> None:
    encode(Message("t", b"v" * 80, key=b"k" * 10), limit=200)
    with pytest.raises(PayloadTooLarge, match="limit is 100"):
        encode(Message("t", b"v" * 60, key=b"k" * 30, headers={"h": b"x" * 20}), limit=100)


def test_serializer_must_return_bytes() -> None:
    class Broken:
        content_type = None

        def serialize(self, value: object) -> Any:
            return "not bytes"

    with pytest.raises(SerializationError, match="returned str"):
        encode_message(Message("t", 1), Broken(), 100)


def test_idempotency_key_must_be_text() -> None:
    with pytest.raises(InvalidMessage, match="idempotency_key"):
        encode(Message("t", b"x", idempotency_key=""))  # type: ignore[arg-type]


def test_bad_outbox_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        Outbox(max_message_bytes=0)
    with pytest.raises(ConfigError):
        Outbox(table="Bad-Name")
    with pytest.raises(ConfigError):
        Outbox(serializer=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="40"):
        OutboxTableSpec(table="t" * 41)


def test_record_from_row_adds_the_id_header_and_refuses_broken_headers() -> None:
    encoded = encode(Message("t", {"v": 1}, headers=[("a", b"1")]))
    record = OutboxRecord.from_row({**encoded.row, "seq": 1})
    assert record.headers == [
        ("outbox-id", str(encoded.id).encode()),
        (CONTENT_TYPE_HEADER, b"application/json"),
        ("a", b"1"),
    ]
    with pytest.raises(ValueError, match="differ in length"):
        OutboxRecord.from_row({**encoded.row, "seq": 1, "header_values": [b"1", b"2"]})
    with pytest.raises(ValueError, match="differ in length"):  # values with no names at all
        OutboxRecord.from_row(
            {**encoded.row, "seq": 1, "header_names": [], "header_values": [b"orphan"]}
        )
    bare = encode(Message("t", b"v")).row
    plain = OutboxRecord.from_row({**bare, "seq": 2, "header_names": None, "header_values": None})
    assert plain.headers == [("outbox-id", str(bare["id"]).encode())]
