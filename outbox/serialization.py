"""Turning message values into bytes.

A serializer is any object with ``serialize(value) -> bytes | None`` and a ``content_type``
(``str | None``, sent as the ``content-type`` header). A serializer whose content type
depends on the value may also define ``content_type_of(value)``. The default,
:class:`JsonSerializer`, passes bytes through (no content type), writes ``str`` as UTF-8 text
and everything else it knows as JSON.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import math
from collections.abc import Callable
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

    Three rules keep a consumer from reading something other than what was published:

    - ``Decimal`` becomes a JSON *string* (``"9.50"``): exact, scale kept, and the same as
      pydantic writes it; a JSON number would be read back as a binary float by most parsers.
    - NaN and infinities (float or Decimal) are refused: JSON has no spelling for them.
    - A naive ``datetime`` (no ``tzinfo``) is refused: its zone would be lost.

    ``default`` is called with any value of a type the serializer does not know and must
    return something it does (a ``str``, a ``dict``, ...) or raise ``TypeError``; see
    docs/publishing.md for an example.
    """

    content_type: str | None = "application/json"

    def __init__(self, default: Callable[[Any], Any] | None = None) -> None:
        self._default = default

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
            encoded = orjson.dumps(value, default=self._fallback, option=_OPTIONS)
        except (TypeError, orjson.JSONEncodeError) as exc:
            reason = exc.__cause__ if isinstance(exc.__cause__, TypeError) else exc  # ours
            raise SerializationError(
                f"cannot serialize {type(value).__name__} to JSON: {reason}"
            ) from exc
        # orjson writes NaN and infinities as null; only then is the value walked for them.
        if b"null" in encoded:
            where = _non_finite_float(value, "value")
            if where is not None:
                raise SerializationError(
                    f"cannot serialize {where}: NaN and infinity have no JSON form"
                )
        return encoded

    def _fallback(self, value: Any) -> Any:
        if isinstance(value, dt.datetime):  # reaches here through OPT_PASSTHROUGH_DATETIME
            if value.tzinfo is None or value.utcoffset() is None:
                raise TypeError(
                    f"naive datetime {value.isoformat()} has no time zone; "
                    "give it a tzinfo (e.g. datetime.UTC)"
                )
            return value.isoformat()
        if isinstance(value, dt.date | dt.time):  # a calendar day or a time of day: no zone
            return value.isoformat()
        if isinstance(value, decimal.Decimal):
            if not value.is_finite():
                raise TypeError(f"Decimal {value} has no JSON form")
            return str(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.asdict(value)
        if isinstance(value, set | frozenset):
            return sorted(value, key=repr)
        if hasattr(value, "model_dump"):
            return value.model_dump(mode="json")
        if self._default is not None:
            return self._default(value)
        raise TypeError(
            f"Type is not JSON serializable: {type(value).__name__} "
            "(JsonSerializer(default=...) can encode it)"
        )


# Datetimes go through the fallback, which refuses naive ones; dataclasses too, so the
# walk for NaN below sees the same fields orjson wrote.
_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATETIME


def _non_finite_float(value: Any, path: str) -> str | None:
    """Where in ``value`` a NaN or infinite float sits (``value["a"][2]``), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path} = {value}"
    if isinstance(value, dict):
        for name, item in value.items():
            found = _non_finite_float(item, f"{path}[{name!r}]")
            if found:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _non_finite_float(item, f"{path}[{index}]")
            if found:
                return found
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for item in dataclasses.fields(value):
            found = _non_finite_float(getattr(value, item.name), f"{path}.{item.name}")
            if found:
                return found
    return None


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
