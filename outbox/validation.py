"""Checks applied to every message at ``publish()``, before anything touches the database."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping
from typing import TypeAlias

from outbox.errors import ConfigError, InvalidHeaders, InvalidKey, InvalidTopic

# Kafka's own rule (org.apache.kafka.common.internals.Topic): ASCII letters, digits, '.', '_',
# '-', at most 249 characters, and not "." or "..".
_TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]+")
MAX_TOPIC_LENGTH = 249

# A plain, unquoted PostgreSQL identifier; at most 63 bytes (NAMEDATALEN - 1).
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")
MAX_IDENTIFIER_LENGTH = 63

#: Header names the outbox itself sets on every Kafka record.
RESERVED_HEADER_PREFIX = "outbox-"

KeyLike: TypeAlias = bytes | str | int | uuid.UUID | None
HeaderValue: TypeAlias = bytes | str | None
HeadersLike: TypeAlias = Mapping[str, HeaderValue] | Iterable[tuple[str, HeaderValue]] | None


def validate_topic(topic: object) -> str:
    """Return ``topic`` if Kafka would accept it as a topic name, else raise InvalidTopic."""
    if isinstance(topic, str) and topic in _valid_topics:
        return topic  # services publish to a handful of topics, over and over
    _check_topic(topic)
    assert isinstance(topic, str)
    if len(_valid_topics) < 10_000:
        _valid_topics.add(topic)
    return topic


_valid_topics: set[str] = set()


def _check_topic(topic: object) -> None:
    if not isinstance(topic, str):
        raise InvalidTopic(f"topic must be a str, got {type(topic).__name__}")
    if not topic:
        raise InvalidTopic("topic must not be empty")
    if topic in {".", ".."}:
        raise InvalidTopic(f"topic cannot be {topic!r}")
    if len(topic) > MAX_TOPIC_LENGTH:
        raise InvalidTopic(
            f"topic is {len(topic)} characters long; Kafka allows {MAX_TOPIC_LENGTH}"
        )
    if not _TOPIC_CHARS.fullmatch(topic):
        bad = sorted({ch for ch in topic if not _TOPIC_CHARS.fullmatch(ch)})
        raise InvalidTopic(
            f"topic {topic!r} has characters Kafka does not allow: {''.join(bad)!r} "
            "(allowed: ASCII letters, digits, '.', '_', '-')"
        )


def validate_identifier(name: object, what: str = "identifier") -> str:
    """Return ``name`` if it is a plain lower-case SQL identifier, else raise ConfigError.

    Schema and table names reach SQL text, so only ``[a-z_][a-z0-9_]*`` is accepted.
    """
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise ConfigError(
            f"{what} must match [a-z_][a-z0-9_]* (a plain lower-case SQL identifier), got {name!r}"
        )
    if len(name.encode()) > MAX_IDENTIFIER_LENGTH:
        raise ConfigError(f"{what} {name!r} is longer than {MAX_IDENTIFIER_LENGTH} bytes")
    return name


def encode_key(key: object) -> bytes | None:
    """The Kafka key bytes for ``key``: bytes as given, str as UTF-8, int and UUID as text."""
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, bool):
        raise InvalidKey("key must not be a bool")
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, int | uuid.UUID):
        return str(key).encode()
    if isinstance(key, bytearray | memoryview):
        return bytes(key)
    raise InvalidKey(f"key must be bytes, str, int, UUID or None, got {type(key).__name__}")


def encode_headers(headers: object) -> list[tuple[str, bytes | None]]:
    """Normalize user headers to ``[(name, bytes | None), ...]`` in the order given."""
    if headers is None:
        return []
    if isinstance(headers, str | bytes):
        raise InvalidHeaders("headers must be a mapping or a sequence of (name, value) pairs")
    items = headers.items() if isinstance(headers, Mapping) else headers
    try:
        pairs = list(items)  # type: ignore[call-overload]
    except TypeError as exc:
        raise InvalidHeaders(
            f"headers must be a mapping or a sequence of (name, value) pairs, "
            f"got {type(headers).__name__}"
        ) from exc
    encoded: list[tuple[str, bytes | None]] = []
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise InvalidHeaders(f"header {pair!r} is not a (name, value) pair")
        name, value = pair
        if not isinstance(name, str) or not name:
            raise InvalidHeaders(f"header name must be a non-empty str, got {name!r}")
        if "\x00" in name:  # PostgreSQL text cannot hold NUL; refuse it here, not at INSERT
            raise InvalidHeaders(f"header name {name!r} contains a NUL character")
        if name.lower().startswith(RESERVED_HEADER_PREFIX):
            raise InvalidHeaders(
                f"header {name!r}: names starting {RESERVED_HEADER_PREFIX!r} are reserved"
            )
        if isinstance(value, str):
            value = value.encode()
        elif isinstance(value, bytearray | memoryview):
            value = bytes(value)
        elif value is not None and not isinstance(value, bytes):
            raise InvalidHeaders(
                f"header {name!r} value must be bytes, str or None, got {type(value).__name__}"
            )
        encoded.append((name, value))
    return encoded
