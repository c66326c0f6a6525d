"""CloudEvents on the outbox: the Kafka protocol binding of CloudEvents 1.0, written at publish.

An outbox made with ``Outbox(..., envelope=CloudEvents(source="/shop/orders"))`` stores every
message as a CloudEvent, so that any CloudEvents consumer reads the records the relay produces:

- **binary** content mode (the default): the value stays the serialized data, the attributes
  go into ``ce_*`` headers (``ce_specversion``, ``ce_id``, ``ce_source``, ``ce_type``,
  ``ce_time``, ``ce_subject``), and ``content-type`` is the data's content type;
- **structured** content mode: the value is the whole event as one JSON object, with
  ``content-type: application/cloudevents+json; charset=utf-8``.

Everything is computed in the caller's process and stored in the row, in the business
transaction: the relay, the immediate sender and the reconciliation send and compare the row
as it is. ``ce_time`` is therefore the time ``publish()`` (or ``prepare()``) was called,
never the time the relay sent it.
"""

from __future__ import annotations

import base64
import datetime as dt
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal

import orjson

from outbox.errors import ConfigError, InvalidCloudEvent, InvalidHeaders, SerializationError
from outbox.validation import validate_topic

#: The CloudEvents version the envelope writes.
SPECVERSION: Final = "1.0"
#: The prefix of the attribute headers in binary mode (the Kafka binding's, lower case).
CE_PREFIX: Final = "ce_"
#: Binary content mode: attributes in ``ce_*`` headers, the data as the record's value.
BINARY: Final = "binary"
#: Structured content mode: the whole event, JSON-encoded, as the record's value.
STRUCTURED: Final = "structured"
#: The content type of a structured-mode record.
STRUCTURED_CONTENT_TYPE: Final = "application/cloudevents+json; charset=utf-8"

Mode = Literal["binary", "structured"]

# What the JSON event format carries as a JSON value rather than as a string or base64.
_JSON_CONTENT_TYPE = re.compile(r"^(application|text)/([a-zA-Z0-9.-]+\+)?json(;.*)?$", re.I)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_WHITESPACE = re.compile(r"\s")


@dataclass(frozen=True)
class Envelope:
    """What the envelope made of one message: the value, content type and headers to store."""

    value: bytes | None
    content_type: str | None
    headers: list[tuple[str, bytes | None]]


@dataclass(frozen=True)
class CloudEvents:
    """Write every message of an outbox as a CloudEvent (pass it as ``Outbox(envelope=...)``).

    ``source``: the ``source`` attribute of every event, a URI reference naming the producer
    (``/shop/orders``, ``https://shop.example.com/orders``). ``types``: the ``type`` of each
    topic's events when ``publish`` is not given ``type=`` (``{"orders":
    "com.example.order.placed"}``); a message with neither is refused with
    :class:`~outbox.errors.InvalidCloudEvent`. ``mode``: ``"binary"`` (default) or
    ``"structured"``.

    Bad settings raise :class:`~outbox.errors.ConfigError` here, when the outbox is made.
    """

    source: str
    types: Mapping[str, str] = field(default_factory=dict, hash=False)  # a mapping: unhashable
    mode: Mode = BINARY

    def __post_init__(self) -> None:
        try:
            check_source(self.source)
            if not isinstance(self.types, Mapping):
                raise InvalidCloudEvent(
                    f"types must map topics to event types, got {type(self.types).__name__}"
                )
            for topic, event_type in self.types.items():
                validate_topic(topic)
                check_attribute("type", event_type)
        except (InvalidCloudEvent, ValueError) as error:
            raise ConfigError(f"CloudEvents: {error}") from error
        if self.mode not in (BINARY, STRUCTURED):
            raise ConfigError(
                f"CloudEvents mode must be {BINARY!r} or {STRUCTURED!r}, got {self.mode!r}"
            )
        # A copy nobody can change after the checks.
        object.__setattr__(self, "types", MappingProxyType(dict(self.types)))

    def type_for(self, topic: str, given: str | None) -> str:
        """The event type of a message: ``given``, else the topic's default."""
        if given is not None:
            return check_attribute("type", given)
        try:
            return self.types[topic]
        except KeyError:
            raise InvalidCloudEvent(
                f"no CloudEvents type for a message to {topic!r}: pass type=... to publish "
                f"or give the topic a default in CloudEvents(types={{{topic!r}: ...}})"
            ) from None

    def wrap(
        self,
        message_id: uuid.UUID,
        topic: str,
        event_type: str | None,
        subject: str | None,
        value: bytes | None,
        content_type: str | None,
        headers: Sequence[tuple[str, bytes | None]],
        time: dt.datetime | None = None,
    ) -> Envelope:
        """The event for one serialized message; raises an InvalidMessage subclass for a bad
        type or subject, or for user ``headers`` that would clash with the event's."""
        check_headers(headers)
        attributes = event_attributes(
            message_id,
            self.source,
            self.type_for(topic, event_type),
            time or dt.datetime.now(dt.UTC),
            None if subject is None else check_attribute("subject", subject),
        )
        if self.mode == BINARY:
            return Envelope(value, content_type, binary_headers(attributes))
        return Envelope(
            structured_value(attributes, value, content_type), STRUCTURED_CONTENT_TYPE, []
        )


def event_attributes(
    message_id: uuid.UUID,
    source: str,
    event_type: str,
    time: dt.datetime,
    subject: str | None = None,
) -> dict[str, str]:
    """The context attributes of one event, in the order they are written."""
    attributes = {
        "specversion": SPECVERSION,
        "id": str(message_id),
        "source": source,
        "type": event_type,
        "time": format_time(time),
    }
    if subject is not None:
        attributes["subject"] = subject
    return attributes


def binary_headers(attributes: Mapping[str, str]) -> list[tuple[str, bytes | None]]:
    """The ``ce_*`` headers of binary content mode (``content-type`` is the row's own)."""
    return [(CE_PREFIX + name, text.encode()) for name, text in attributes.items()]


def structured_value(
    attributes: Mapping[str, str], value: bytes | None, content_type: str | None
) -> bytes:
    """The event in the JSON event format: the attributes, ``datacontenttype`` and the data.

    JSON data is embedded as JSON (it must parse), text as a string, anything else (bytes
    without a content type, binary formats) as ``data_base64``. A value of None (a Kafka
    tombstone in binary mode) makes an event without data.
    """
    event: dict[str, Any] = dict(attributes)
    if value is None:
        return orjson.dumps(event)
    if content_type is not None:
        event["datacontenttype"] = content_type
    if content_type is not None and _JSON_CONTENT_TYPE.match(content_type):
        try:
            orjson.loads(value)
        except orjson.JSONDecodeError as error:
            raise SerializationError(
                f"the serializer said {content_type!r} but wrote bytes that are not JSON: {error}"
            ) from error
        event["data"] = orjson.Fragment(value)
    elif content_type is not None and content_type.lower().startswith("text/"):
        try:
            event["data"] = value.decode()
        except UnicodeDecodeError:
            event["data_base64"] = base64.b64encode(value).decode()
    else:
        event["data_base64"] = base64.b64encode(value).decode()
    return orjson.dumps(event)


def format_time(time: dt.datetime) -> str:
    """``time`` in RFC 3339, in UTC, with microseconds (``2026-11-27T22:05:39.123456Z``)."""
    if time.tzinfo is None or time.utcoffset() is None:
        raise InvalidCloudEvent(f"time {time.isoformat()} has no time zone")
    if time.tzinfo is not dt.UTC:  # publish's own clock is in UTC already: skip the cost
        time = time.astimezone(dt.UTC)
    return time.isoformat(timespec="microseconds").removesuffix("+00:00") + "Z"


def check_attribute(name: str, value: object) -> str:
    """``value`` if it can be the attribute ``name``: a non-empty str without control
    characters; else :class:`~outbox.errors.InvalidCloudEvent`."""
    if not isinstance(value, str):
        raise InvalidCloudEvent(f"CloudEvents {name} must be a str, got {type(value).__name__}")
    if not value.strip():
        raise InvalidCloudEvent(f"CloudEvents {name} must not be empty")
    if _CONTROL.search(value):
        raise InvalidCloudEvent(f"CloudEvents {name} {value!r} contains a control character")
    return value


def check_source(value: object) -> str:
    """``value`` if it can be a ``source`` (a URI reference: no spaces either)."""
    source = check_attribute("source", value)
    if _WHITESPACE.search(source):
        raise InvalidCloudEvent(
            f"CloudEvents source {source!r} is not a URI reference: it contains whitespace"
        )
    return source


def check_headers(headers: Sequence[tuple[str, bytes | None]]) -> None:
    """Refuse user headers the envelope writes itself: ``ce_*`` and ``content-type``."""
    for name, _ in headers:
        lowered = name.lower()
        if lowered.startswith(CE_PREFIX) or lowered == "content-type":
            raise InvalidHeaders(
                f"header {name!r} clashes with the CloudEvents envelope, which writes the "
                f"{CE_PREFIX}* headers and content-type itself (pass type= and subject= instead)"
            )


def record_identity(headers: Sequence[tuple[str, bytes | None]], value: bytes | None) -> str | None:
    """The message identity of a CloudEvent record that has no ``outbox-id`` header, or None.

    A ``ce_id`` that is a UUID (what this outbox writes) is the identity as it is, in its
    canonical text, so that it matches the ``outbox-id`` of the same message. Any other id is
    unique only within its source (the CloudEvents rule), so the identity is
    ``source + " " + id``. A structured-mode record's id and source are read from its value.
    """
    event_id = source = None
    structured = False
    for name, raw in headers:
        lowered = name.lower()
        if lowered == "ce_id" and raw is not None:
            event_id = raw.decode("utf-8", errors="replace")
        elif lowered == "ce_source" and raw is not None:
            source = raw.decode("utf-8", errors="replace")
        elif lowered == "content-type" and raw is not None:
            structured = raw.lower().startswith(b"application/cloudevents+json")
    if event_id is None and structured and value:
        event_id, source = _structured_id(value)
    if not event_id:
        return None
    try:
        return str(uuid.UUID(event_id))
    except ValueError:
        return f"{source or ''} {event_id}"


def _structured_id(value: bytes) -> tuple[str | None, str | None]:
    try:
        event = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(event, dict):
        return None, None
    event_id, source = event.get("id"), event.get("source")
    return (
        event_id if isinstance(event_id, str) else None,
        source if isinstance(source, str) else None,
    )
