"""Turning message values into bytes.

A serializer is any object with ``serialize(value) -> bytes | None`` and a ``content_type``
(``str | None``, sent as the ``content-type`` header). A serializer whose content type
depends on the value may also define ``content_type_of(value)``. The default,
:class:`JsonSerializer`, passes bytes through (no content type), writes ``str`` as UTF-8 text
and everything else it knows as JSON.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import orjson

from outbox.errors import SerializationError


@runtime_checkable
class Serializer(Protocol):
    """Protocol for pluggable value serializers.

    ``serialize`` must return ``bytes`` (or ``None`` for a Kafka tombstone) and raise
    :class:`~outbox.errors.SerializationError` (or any ``TypeError``/``ValueError``, which the
    outbox wraps) for values it cannot encode.
    """

    content_type: str | None

    def serialize(self, value: Any) -> bytes | None: ...


class JsonSerializer:
    """bytes pass through; dicts, lists, dataclasses, pydantic models and scalars become JSON.

    JSON is written with ``orjson`` (UTF-8, compact), which also handles datetimes, UUIDs and
    enums. ``str`` values are written as UTF-8 text, not as a JSON string.
    """

    content_type: str | None = "application/json"

    def content_type_of(self, value: Any) -> str | None:
        if isinstance(value, bytes | bytearray | memoryview):
            return None
        if isinstance(value, str):
            return "text/plain; charset=utf-8"
        return self.content_type

    def serialize(self, value: Any) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value
        if isinstance(value, bytearray | memoryview):
            return bytes(value)
        if isinstance(value, str):
            return value.encode()
        if hasattr(value, "model_dump") and callable(value.model_dump):  # pydantic v2
            value = value.model_dump(mode="json")
        try:
            return orjson.dumps(value, default=_fallback, option=orjson.OPT_NON_STR_KEYS)
        except (TypeError, orjson.JSONEncodeError) as exc:
            raise SerializationError(
                f"cannot serialize {type(value).__name__} to JSON: {exc}"
            ) from exc


def _fallback(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def content_type_of(serializer: Serializer, value: Any) -> str | None:
    """The content type to label ``value`` with, asking the serializer per value if it can."""
    per_value = getattr(serializer, "content_type_of", None)
    if callable(per_value):
        result = per_value(value)
        return str(result) if result is not None else None
    return serializer.content_type


class BytesSerializer:
    """Accepts only ``bytes`` (or ``None``): for callers that encode values themselves."""

    content_type: str | None = None

    def serialize(self, value: Any) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value
        raise SerializationError(f"BytesSerializer takes bytes, got {type(value).__name__}")
