"""A message's key: omitted or NO_KEY means none; an explicit None is refused before any write,
because it is most often an id the database has not generated yet."""

from __future__ import annotations

import pytest

import outbox
from outbox.message import Message, encode_message
from outbox.serialization import JsonSerializer


def encode(message: Message) -> dict[str, object]:
    return encode_message(message, JsonSerializer(), 1_000_000).row


def test_a_message_without_a_key_has_none() -> None:
    assert "key" not in encode(Message("orders", {"n": 1}))
    assert "key" not in encode(Message("orders", {"n": 1}, key=outbox.NO_KEY))


def test_an_explicit_none_key_is_refused_with_the_reason() -> None:
    with pytest.raises(outbox.InvalidKey, match=r"'orders'.*flush.*NO_KEY"):
        encode(Message("orders", {"order_id": None}, key=None))


@pytest.mark.parametrize(
    ("key", "stored"), [(7, b"7"), ("k", b"k"), (b"\x00", b"\x00"), (0, b"0"), ("", b"")]
)
def test_falsy_and_plain_keys_are_kept(key: object, stored: bytes) -> None:
    assert encode(Message("orders", 1, key=key))["key"] == stored  # type: ignore[arg-type]
