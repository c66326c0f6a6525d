"""Turning message values back into Python values: the reverse of ``outbox.serialization``.

The outbox labels each record with a ``content-type`` header (see docs/consuming.md): JSON
(``application/json``), UTF-8 text (``text/plain; charset=utf-8``), or none for raw bytes.
:class:`JsonDeserializer` reads all three back. A value it cannot read raises
:class:`UndecodableValue`: the inbox runner parks that message at once (retrying would not
help); a check-back checker gets the undecoded bytes. Used by the inbox
(:mod:`outbox.inbox`) and by check-back (:mod:`outbox.prepared`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import orjson

from outbox.errors import OutboxError
from outbox.serialization import JsonSerializer


class UndecodableValue(OutboxError, ValueError):
    """A value could not be decoded; the inbox runner parks such a message at once."""


@runtime_checkable
class Deserializer(Protocol):
    """``deserialize(value, content_type) -> Any``; raise :class:`UndecodableValue` (or any
    ``ValueError``) for bytes it cannot read."""

    def deserialize(self, value: bytes | None, content_type: str | None) -> Any: ...


_JSON = JsonSerializer.content_type


class JsonDeserializer:
    """What :class:`~outbox.JsonSerializer` wrote: JSON to Python, text to ``str``, else bytes.

    Decimals arrive as JSON strings and datetimes as ISO 8601 strings (as they were written);
    convert them in the handler. A tombstone (no value) is ``None``.
    """

    def deserialize(self, value: bytes | None, content_type: str | None) -> Any:
        if value is None:
            return None
        if content_type is None:
            return value
        media = content_type.split(";")[0].strip().lower()
        try:
            if media == _JSON or media.endswith("+json"):
                return orjson.loads(value)
            if media.startswith("text/"):
                return value.decode("utf-8")
        except (orjson.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UndecodableValue(f"cannot decode {content_type} value: {exc}") from exc
        return value


class BytesDeserializer:
    """Leaves values as bytes, whatever their content type."""

    def deserialize(self, value: bytes | None, content_type: str | None) -> Any:
        return value


def last_header(headers: Iterable[tuple[str, bytes | None]], name: str) -> bytes | None:
    """The last value of header ``name`` among ``headers``, or None (Kafka allows repeats)."""
    found = None
    for key, value in headers:
        if key == name:
            found = value
    return found
