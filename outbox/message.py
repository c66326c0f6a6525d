"""A message as the caller gives it, and as the outbox table stores it."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from outbox.delivery_time import delivery_time
from outbox.errors import (
    InvalidCloudEvent,
    InvalidKey,
    InvalidMessage,
    PayloadTooLarge,
    SerializationError,
)
from outbox.ids import uuid7
from outbox.schema import SCHEDULED, shard_of
from outbox.serialization import Serializer, content_type_of
from outbox.validation import (
    HeadersLike,
    KeyLike,
    encode_headers,
    encode_key,
    validate_topic,
)

if TYPE_CHECKING:
    from outbox.cloudevents import CloudEvents

#: Kafka record header carrying the outbox message id (a UUID in text form).
ID_HEADER = "outbox-id"
#: Kafka record header carrying the serializer's content type, when it has one.
CONTENT_TYPE_HEADER = "content-type"


class NoKey(enum.Enum):
    """The type of :data:`NO_KEY`."""

    NO_KEY = "NO_KEY"


#: "This message has no key", said on purpose: the default of ``key``. An explicit
#: ``key=None`` is refused, because it is most often an id the database has not generated yet
#: (an ORM object not flushed), which would otherwise publish a key-less message silently.
NO_KEY: Final = NoKey.NO_KEY


@dataclass(frozen=True)
class Message:
    """One message to publish; see :meth:`outbox.Outbox.publish` for the fields.

    ``type`` and ``subject`` are the CloudEvents attributes of an outbox with a CloudEvents
    envelope (see :class:`outbox.cloudevents.CloudEvents`).
    """

    topic: str
    value: Any = None
    key: KeyLike | NoKey = NO_KEY
    headers: HeadersLike = None
    idempotency_key: str | None = None
    #: Not before this long after the publish, or this aware datetime: see docs/scheduled.md.
    deliver_after: float | timedelta | None = None
    deliver_at: datetime | None = None
    # Keyword-only: Message(topic, value, key, type="...") reads better, and the
    # positional order of the fields above stays what it was.
    type: str | None = field(default=None, kw_only=True)
    subject: str | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class PublishResult:
    """What ``publish`` did with one message.

    ``duplicate`` is true when a message with the same idempotency key already existed; then
    ``message_id`` is that earlier message's id and nothing new was written.
    """

    message_id: uuid.UUID
    duplicate: bool = False


@dataclass(frozen=True)
class EncodedMessage:
    """A validated message, ready to insert; ``row`` maps column names to values."""

    id: uuid.UUID
    row: dict[str, Any] = field(repr=False)
    idempotency_key: str | None
    #: When it may be delivered (a scheduled message), None when at once.
    deliver_at: datetime | None = None


def _given_key(key: KeyLike, topic: str) -> KeyLike:
    if key is None:
        raise InvalidKey(
            f"key is None for a message to {topic!r}: an id the database generates is None "
            "until the session is flushed (`session.flush()` before publishing); for a message "
            "without a key, leave `key` out or pass `key=outbox.NO_KEY`"
        )
    return key


def encode_message(
    message: Message,
    serializer: Serializer,
    max_message_bytes: int,
    trace_headers: Sequence[tuple[str, bytes]] = (),
    envelope: CloudEvents | None = None,
) -> EncodedMessage:
    """Validate and serialize ``message``; raises an InvalidMessage subclass on bad input.

    ``trace_headers`` (the publisher's trace context) are added after the message's own
    headers, except those the message sets itself. ``envelope`` wraps the message as a
    CloudEvent (its headers, or its whole value in structured mode).
    """
    topic = validate_topic(message.topic)
    deliver_at = delivery_time(message.deliver_after, message.deliver_at)
    key = None if message.key is NO_KEY else encode_key(_given_key(message.key, topic))
    headers = encode_headers(message.headers)
    if envelope is None and (message.type is not None or message.subject is not None):
        raise InvalidCloudEvent(
            "type= and subject= are CloudEvents attributes: they need an outbox made with "
            "envelope=CloudEvents(...)"
        )
    if trace_headers:
        given = {name for name, _ in headers}
        headers.extend(pair for pair in trace_headers if pair[0] not in given)
    if message.idempotency_key is not None and (
        not isinstance(message.idempotency_key, str) or not message.idempotency_key
    ):
        raise InvalidMessage("idempotency_key must be a non-empty str or None")
    if message.idempotency_key is not None and "\x00" in message.idempotency_key:
        raise InvalidMessage("idempotency_key must not contain a NUL character")
    try:
        value = serializer.serialize(message.value)
    except SerializationError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise SerializationError(f"cannot serialize {type(message.value).__name__}: {exc}") from exc
    if value is not None and not isinstance(value, bytes):
        raise SerializationError(
            f"serializer {type(serializer).__name__} returned {type(value).__name__}, not bytes"
        )
    content_type = content_type_of(serializer, message.value) if value is not None else None
    message_id = uuid7()
    if envelope is not None:
        wrapped = envelope.wrap(
            message_id, topic, message.type, message.subject, value, content_type, headers
        )
        value, content_type = wrapped.value, wrapped.content_type
        headers = wrapped.headers + headers
    size = (
        len(value or b"")
        + len(key or b"")
        + sum(len(name) + len(header or b"") for name, header in headers)
        + (len(CONTENT_TYPE_HEADER) + len(content_type) if content_type else 0)
    )
    if size > max_message_bytes:
        raise PayloadTooLarge(
            f"message for topic {topic!r} is {size} bytes; the limit is {max_message_bytes} "
            "(max_message_bytes, which must not exceed the topic's max.message.bytes)"
        )
    # Only the columns that have a value: a shorter INSERT is a faster one.
    row: dict[str, Any] = {
        "id": message_id,
        "shard": shard_of(key, message_id),
        "topic": topic,
    }
    if key is not None:
        row["key"] = key
    if value is not None:
        row["value"] = value
    if content_type is not None:
        row["content_type"] = content_type
    if headers:
        row["header_names"] = [name for name, _ in headers]
        row["header_values"] = [header for _, header in headers]
    if message.idempotency_key is not None:
        row["idempotency_key"] = message.idempotency_key
    if deliver_at is not None:
        row["status"] = SCHEDULED
        row["deliver_at"] = deliver_at
    return EncodedMessage(message_id, row, message.idempotency_key, deliver_at)
