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
import enum
import math
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import orjson

from outbox.errors import LossyConversion, SerializationError


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

    Nothing is changed without a word: what JSON cannot hold as it is raises
    :class:`~outbox.errors.LossyConversion` naming where it sits (``value['tags']``):

    - a ``set`` or ``frozenset`` (JSON has arrays, not sets; pass a list, e.g. ``sorted(...)``);
    - a dict key that is not a ``str`` (``{1: "a"}`` would be read back as ``{"1": "a"}``);
    - NaN and infinities (float or Decimal): JSON has no spelling for them;
    - a naive ``datetime`` (no ``tzinfo``): its zone would be lost.

    ``Decimal`` becomes a JSON *string* (``"9.50"``): exact, scale kept, and the same as
    pydantic writes it; a JSON number would be read back as a binary float by most parsers.
    Every other refusal (an unknown type, an integer beyond 64 bits) is a
    :class:`~outbox.errors.SerializationError` that names the path too.

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
            encoded = self._after_refusal(value, exc)
        # orjson writes NaN and infinities as null; only then is the value walked for them.
        if b"null" in encoded:
            problems = find_problems(value, self._fallback)
            lossy = [p for p in problems if isinstance(p, LossyConversion)]
            if lossy:
                raise refusal(lossy)
        return encoded

    def _after_refusal(self, value: Any, exc: Exception) -> bytes:
        """orjson refused ``value``: the error naming where and why, or the bytes when all it
        refused were keys that are ``str`` subclasses (a ``StrEnum``), whose text is the key."""
        # Raised without orjson's error as its cause: the refusal says all it said, and where.
        problems = find_problems(value, self._fallback)
        if problems:
            raise refusal(problems) from None
        if str(exc) == "Dict key must be str":
            try:
                return orjson.dumps(
                    value, default=self._fallback, option=_OPTIONS | orjson.OPT_NON_STR_KEYS
                )
            except (TypeError, orjson.JSONEncodeError) as again:
                exc = again
        reason = exc.__cause__ if isinstance(exc.__cause__, TypeError) else exc  # ours
        raise SerializationError(
            f"cannot serialize value ({type(value).__name__}) to JSON: {reason}", path=ROOT
        ) from None

    def _fallback(self, value: Any) -> Any:
        if isinstance(value, dt.datetime):  # reaches here through OPT_PASSTHROUGH_DATETIME
            if value.tzinfo is None or value.utcoffset() is None:
                raise _WouldLose(
                    f"naive datetime {value.isoformat()} has no time zone; "
                    "give it a tzinfo (e.g. datetime.UTC)"
                )
            return value.isoformat()
        if isinstance(value, dt.date | dt.time):  # a calendar day or a time of day: no zone
            return value.isoformat()
        if isinstance(value, decimal.Decimal):
            if not value.is_finite():
                raise _WouldLose(f"Decimal {value} has no JSON form")
            return str(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.asdict(value)
        if isinstance(value, set | frozenset):
            raise _WouldLose(
                f"a {type(value).__name__} has no JSON form (an array would lose that it is "
                "one, in no fixed order): pass a list, e.g. sorted(...)"
            )
        if hasattr(value, "model_dump"):
            return value.model_dump(mode="json")
        if self._default is not None:
            return self._default(value)
        raise TypeError(
            f"Type is not JSON serializable: {type(value).__name__} "
            "(JsonSerializer(default=...) can encode it)"
        )


class _WouldLose(TypeError):
    """Raised by the fallback for a value JSON would change: becomes LossyConversion."""


# Datetimes go through the fallback, which refuses naive ones. Dict keys must be str (no
# OPT_NON_STR_KEYS): {1: "a"} would come back as {"1": "a"}.
_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME

#: How paths into a value start: ``value['lines'][2].price``.
ROOT = "value"

# orjson's integer range: a signed or an unsigned 64-bit integer.
_INT_RANGE = range(-(2**63), 2**64)


#: The most refusals one error names; the others are counted.
MAX_PROBLEMS = 20


def refusal(problems: Sequence[SerializationError]) -> SerializationError:
    """One error for every place in a value that JSON cannot hold: the first one's path and
    message, then each other's (``paths`` lists them all). A :class:`LossyConversion` when
    every one of them is."""
    if len(problems) == 1:
        return problems[0]
    prefix = "cannot serialize "
    shown = [str(p).removeprefix(prefix) for p in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        shown.append(f"and {len(problems) - MAX_PROBLEMS} more")
    lossy = all(isinstance(p, LossyConversion) for p in problems)
    kind = LossyConversion if lossy else SerializationError
    paths = [p.path for p in problems if p.path is not None]
    return kind(prefix + "; ".join(shown), path=problems[0].path, paths=paths)


def find_problems(
    value: Any, fallback: Callable[[Any], Any], path: str = ROOT, depth: int = 0
) -> list[SerializationError]:
    """Everything in ``value`` that JSON cannot hold as it is, as errors, in the order met.

    Walks the value as orjson does (dataclass fields not starting with ``_``, enums by their
    value, other types through ``fallback``); called only after orjson refused a value or wrote
    a null, so the fast path stays orjson's.
    """
    if depth > 200:  # a cycle or a value nested deeper than orjson would go
        return []
    if value is None or isinstance(value, bool | uuid.UUID | orjson.Fragment):
        return []
    if isinstance(value, enum.Enum):
        return find_problems(value.value, fallback, path, depth + 1)
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            return [SerializationError(f"cannot serialize {path}: {exc.reason}", path=path)]
        return []
    if isinstance(value, int):
        if value in _INT_RANGE:
            return []
        text = f"{path} = {value}: JSON integers are limited to 64 bits here; send it as a str"
        return [SerializationError(f"cannot serialize {text}", path=path)]
    if isinstance(value, float):
        if math.isfinite(value):
            return []
        text = f"{path} = {value}: NaN and infinity have no JSON form"
        return [LossyConversion(f"cannot serialize {text}", path=path)]
    if isinstance(value, dict):
        return _problems_in_dict(value, fallback, path, depth)
    if isinstance(value, list | tuple):
        return [
            problem
            for index, item in enumerate(value)
            for problem in find_problems(item, fallback, f"{path}[{index}]", depth + 1)
        ]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [
            problem
            for item in dataclasses.fields(value)
            if not item.name.startswith("_")  # orjson leaves these out
            for problem in find_problems(
                getattr(value, item.name), fallback, f"{path}.{item.name}", depth + 1
            )
        ]
    try:
        converted = fallback(value)
    except _WouldLose as exc:
        return [LossyConversion(f"cannot serialize {path}: {exc}", path=path)]
    except (TypeError, ValueError) as exc:
        return [SerializationError(f"cannot serialize {path}: {exc}", path=path)]
    if converted is value:
        return []
    return find_problems(converted, fallback, path, depth + 1)


def _problems_in_dict(
    value: dict[Any, Any], fallback: Callable[[Any], Any], path: str, depth: int
) -> list[SerializationError]:
    problems: list[SerializationError] = []
    for key, item in value.items():
        if not isinstance(key, str):
            problems.append(
                LossyConversion(
                    f"cannot serialize {path}: its key {key!r} is a {type(key).__name__}, and "
                    f"JSON keys are strings (it would be read back as {str(key)!r}); convert "
                    "the keys to str yourself",
                    path=path,
                )
            )
            continue
        problems += find_problems(item, fallback, f"{path}[{key!r}]", depth + 1)
    return problems


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
