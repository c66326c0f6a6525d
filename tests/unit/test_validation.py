import uuid

import pytest

from outbox.errors import ConfigError, InvalidHeaders, InvalidKey, InvalidTopic
from outbox.validation import encode_headers, encode_key, validate_identifier, validate_topic


@pytest.mark.parametrize("topic", ["orders", "a", "orders.v1", "my_topic-2", "x" * 249, "..."])
def test_legal_topics_pass(topic: str) -> None:
    assert validate_topic(topic) == topic


@pytest.mark.parametrize(
    ("topic", "reason"),
    [
        ("", "empty"),
        (".", "cannot be"),
        ("..", "cannot be"),
        ("x" * 250, "249"),
        ("with space", "' '"),
        ("slash/topic", "'/'"),
        ("ünïcode", "ü"),
        (b"bytes", "must be a str"),
        (None, "must be a str"),
    ],
)
def test_illegal_topics_are_refused_with_the_reason(topic: object, reason: str) -> None:
    with pytest.raises(InvalidTopic, match=reason):
        validate_topic(topic)


def test_keys_become_bytes() -> None:
    some_id = uuid.uuid4()
    assert encode_key(None) is None
    assert encode_key(b"\x00raw") == b"\x00raw"
    assert encode_key("ключ") == "ключ".encode()
    assert encode_key(42) == b"42"
    assert encode_key(some_id) == str(some_id).encode()
    assert encode_key(bytearray(b"ab")) == b"ab"


def test_key_bytes_are_what_docs_publishing_md_promises() -> None:
    # Consumers rely on these exact bytes (docs/publishing.md, "What reaches Kafka").
    assert encode_key(-12) == b"-12"
    assert encode_key(10**20) == b"100000000000000000000"
    assert encode_key(7) == encode_key("7") == encode_key(b"7")
    assert encode_key(uuid.UUID(int=255)) == b"00000000-0000-0000-0000-0000000000ff"
    assert encode_key("café-7") == b"caf\xc3\xa9-7"
    assert encode_key(memoryview(b"\x00\x07")) == b"\x00\x07"


@pytest.mark.parametrize("key", [1.5, True, ["a"], {"a": 1}, object()])
def test_other_key_types_are_refused(key: object) -> None:
    with pytest.raises(InvalidKey):
        encode_key(key)


def test_headers_from_mapping_or_pairs_keep_order_and_duplicates() -> None:
    assert encode_headers({"a": "1", "b": b"2", "c": None}) == [
        ("a", b"1"),
        ("b", b"2"),
        ("c", None),
    ]
    assert encode_headers([("a", b"1"), ("a", b"2")]) == [("a", b"1"), ("a", b"2")]
    assert encode_headers(None) == []


@pytest.mark.parametrize(
    "headers",
    [
        "a=1",
        b"raw",
        5,
        [("a",)],
        [(1, b"x")],
        [("", b"x")],
        {"a": 1},
        {"OUTBOX-ID": b"x"},
        {"a\x00b": b"x"},
    ],
)
def test_bad_headers_are_refused(headers: object) -> None:
    with pytest.raises(InvalidHeaders):
        encode_headers(headers)


@pytest.mark.parametrize("name", ["outbox", "my_schema", "_x1"])
def test_plain_identifiers_pass(name: str) -> None:
    assert validate_identifier(name) == name


@pytest.mark.parametrize(
    "name", ["Outbox", "1x", "a-b", 'x"; drop table t; --', "", "a" * 64, None]
)
def test_identifiers_that_would_need_quoting_are_refused(name: object) -> None:
    with pytest.raises(ConfigError):
        validate_identifier(name)
