import dataclasses
import datetime as dt
import decimal
import enum
import math
import re
import traceback
import uuid

import orjson
import pydantic
import pytest

from outbox.errors import LossyConversion, SerializationError
from outbox.message import Message, encode_message
from outbox.serialization import BytesSerializer, JsonSerializer, Serializer


@dataclasses.dataclass
class Placed:
    order_id: int
    at: dt.datetime


class PlacedModel(pydantic.BaseModel):
    order_id: int
    amount: decimal.Decimal
    ratio: float = 0.5


@dataclasses.dataclass
class Reading:
    level: float


def test_json_serializer_handles_common_values() -> None:
    json = JsonSerializer()
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    assert json.serialize(b"\x00raw") == b"\x00raw"
    assert json.serialize(None) is None
    assert json.serialize("text") == b"text"
    assert json.serialize({"a": [1, 2]}) == b'{"a":[1,2]}'
    assert json.serialize(Placed(1, when)) == b'{"order_id":1,"at":"2026-01-02T03:04:05+00:00"}'
    assert json.serialize(PlacedModel(order_id=2, amount=decimal.Decimal("9.50"))) == (
        b'{"order_id":2,"amount":"9.50","ratio":0.5}'
    )
    some_id = uuid.UUID(int=1)
    assert json.serialize([some_id]) == f'["{some_id}"]'.encode()


@pytest.mark.parametrize("value", [object(), {"f": lambda: 1}, {1j}])
def test_json_serializer_refuses_what_json_cannot_hold(value: object) -> None:
    with pytest.raises(SerializationError, match="cannot serialize"):
        JsonSerializer().serialize(value)


def test_bytes_serializer_takes_only_bytes() -> None:
    assert BytesSerializer().serialize(b"x") == b"x"
    with pytest.raises(SerializationError):
        BytesSerializer().serialize({"a": 1})


def test_custom_serializers_satisfy_the_protocol() -> None:
    class Upper:
        content_type = "text/plain"

        def serialize(self, value: object) -> bytes:
            return str(value).upper().encode()

    assert isinstance(Upper(), Serializer)
    assert not isinstance(object(), Serializer)


def test_decimal_is_an_exact_json_string() -> None:
    encoded = JsonSerializer().serialize({"total": decimal.Decimal("19.90"), "n": 1})
    assert encoded == b'{"total":"19.90","n":1}'
    assert decimal.Decimal(orjson.loads(encoded)["total"]) == decimal.Decimal("19.90")


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (float("nan"), "value = nan"),
        ({"a": [1.0, float("inf")]}, "value['a'][1] = inf"),
        (Reading(-math.inf), "value.level = -inf"),
        (PlacedModel(order_id=1, amount=decimal.Decimal(1), ratio=math.nan), "['ratio']"),
        (decimal.Decimal("NaN"), "Decimal NaN"),
        ({"a": decimal.Decimal("-Infinity")}, "Decimal -Infinity"),
    ],
)
def test_nan_and_infinity_are_refused_not_written_as_null(value: object, where: str) -> None:
    with pytest.raises(SerializationError, match=re.escape(where)):
        JsonSerializer().serialize(value)


def test_a_real_null_is_still_null() -> None:
    assert JsonSerializer().serialize({"a": None, "b": [1.5]}) == b'{"a":null,"b":[1.5]}'


def test_naive_datetimes_are_refused_aware_ones_keep_their_offset() -> None:
    with pytest.raises(SerializationError, match="naive datetime 2026-01-02T03:04:05"):
        JsonSerializer().serialize({"at": dt.datetime(2026, 1, 2, 3, 4, 5)})
    paris = dt.timezone(dt.timedelta(hours=1))
    assert JsonSerializer().serialize([dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=paris)]) == (
        b'["2026-01-02T03:04:05.000006+01:00"]'
    )
    assert JsonSerializer().serialize([dt.date(2026, 1, 2), dt.time(3, 4)]) == (
        b'["2026-01-02","03:04:00"]'
    )


class Money:
    def __init__(self, cents: int, currency: str) -> None:
        self.cents, self.currency = cents, currency


def encode_money(value: object) -> object:
    if isinstance(value, Money):
        return {"cents": value.cents, "currency": value.currency}
    raise TypeError(f"cannot encode {type(value).__name__}")


def test_default_hook_encodes_the_callers_own_types() -> None:
    json = JsonSerializer(default=encode_money)
    assert json.serialize({"price": Money(990, "EUR")}) == (
        b'{"price":{"cents":990,"currency":"EUR"}}'
    )
    with pytest.raises(SerializationError, match="cannot encode object"):
        json.serialize(object())
    with pytest.raises(SerializationError, match="default="):
        JsonSerializer().serialize(Money(1, "EUR"))


class Colour(enum.StrEnum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 1


@dataclasses.dataclass
class Tagged:
    name: str
    tags: set[str]


@dataclasses.dataclass
class WithPrivate:
    shown: int
    _cache: float


@pytest.mark.parametrize(
    ("value", "path", "what"),
    [
        ({"tags": {"b", "a"}}, "value['tags']", "a set has no JSON form"),
        ([1, frozenset({2})], "value[1]", "a frozenset has no JSON form"),
        (Tagged("x", {"a"}), "value.tags", "pass a list"),
        ({"by_id": {1: "a"}}, "value['by_id']", "its key 1 is a int"),
        ({uuid.UUID(int=7): 1}, "value", "is a UUID"),
        ({"n": {(1, 2): "pair"}}, "value['n']", "is a tuple"),
        ({True: "yes"}, "value", "is a bool"),
        ({Level.HIGH: "h"}, "value", "is a Level"),
        ({"at": dt.datetime(2026, 1, 2, 3, 4, 5)}, "value['at']", "naive datetime"),
        ({"a": [float("nan")]}, "value['a'][0]", "NaN and infinity have no JSON form"),
    ],
)
def test_what_json_would_change_is_refused_naming_where(
    value: object, path: str, what: str
) -> None:
    with pytest.raises(LossyConversion) as caught:
        JsonSerializer().serialize(value)
    assert caught.value.path == path
    assert str(caught.value).startswith(f"cannot serialize {path}")
    assert what in str(caught.value)


def test_a_set_is_not_written_as_a_sorted_list() -> None:
    """Before, {"tags": {"b", "a"}} became {"tags": ["a", "b"]} without a word."""
    with pytest.raises(LossyConversion, match=re.escape("value['tags']")):
        JsonSerializer().serialize({"tags": {"b", "a"}})
    assert JsonSerializer().serialize({"tags": sorted({"b", "a"})}) == b'{"tags":["a","b"]}'


def test_non_string_keys_are_not_turned_into_strings() -> None:
    """Before, {1: "a"} became {"1": "a"}: read back, the key is another type."""
    with pytest.raises(LossyConversion, match="read back as '1'"):
        JsonSerializer().serialize({1: "a"})


def test_keys_that_are_str_subclasses_keep_their_text() -> None:
    assert JsonSerializer().serialize({Colour.RED: 1, "plain": {Colour.RED: 2}}) == (
        b'{"red":1,"plain":{"red":2}}'
    )


@pytest.mark.parametrize(
    ("value", "path", "what"),
    [
        ({"when": object()}, "value['when']", "not JSON serializable: object"),
        ([1, {"raw": b"x"}], "value[1]['raw']", "not JSON serializable: bytes"),
        ({"n": 2**70}, "value['n']", "limited to 64 bits"),
        (Reading(1.0), None, None),  # a control: this one is fine
        ({"s": "a\ud800"}, "value['s']", "surrogates not allowed"),
        ([PlacedModel(order_id=1, amount=decimal.Decimal(1)), object()], "value[1]", "object"),
    ],
)
def test_every_other_refusal_names_its_path_too(
    value: object, path: str | None, what: str | None
) -> None:
    if path is None:
        assert JsonSerializer().serialize(value) == b'{"level":1.0}'
        return
    with pytest.raises(SerializationError) as caught:
        JsonSerializer().serialize(value)
    assert not isinstance(caught.value, LossyConversion)
    assert caught.value.path == path
    assert str(caught.value).startswith(f"cannot serialize {path}")
    assert what is not None and what in str(caught.value)


def test_the_default_hooks_output_is_held_to_the_same_rules() -> None:
    """A hook that returns NaN or a set gets the same refusal, at the hooked value's path."""

    def encode(value: object) -> object:
        if isinstance(value, Money):
            return {"cents": float("nan") if value.cents < 0 else value.cents, "tags": {"x"}}
        raise TypeError(f"cannot encode {type(value).__name__}")

    json = JsonSerializer(default=encode)
    with pytest.raises(LossyConversion, match=re.escape("value['price']['cents'] = nan")):
        json.serialize({"price": Money(-1, "EUR")})
    with pytest.raises(LossyConversion, match=re.escape("value['price']['tags']")):
        json.serialize({"price": Money(1, "EUR")})
    with pytest.raises(SerializationError, match=re.escape("value['x']: cannot encode object")):
        json.serialize({"x": object()})


def test_private_dataclass_fields_are_left_out_as_documented() -> None:
    assert JsonSerializer().serialize(WithPrivate(1, math.nan)) == b'{"shown":1}'


def test_publish_refuses_the_value_before_anything_is_written() -> None:
    message = Message(topic="orders", value={"lines": [{"sku": "a", "tags": {"gift"}}]})
    with pytest.raises(LossyConversion) as caught:
        encode_message(message, JsonSerializer(), 1_000_000)
    assert caught.value.path == "value['lines'][0]['tags']"


def test_every_field_that_fails_is_named_not_only_the_first() -> None:
    value = {
        "tags": {"gift"},
        "lines": [{"price": float("nan")}, {"price": 1.0}],
        "at": dt.datetime(2026, 1, 2, 3, 4, 5),
    }
    with pytest.raises(LossyConversion) as caught:
        JsonSerializer().serialize(value)
    assert caught.value.paths == ("value['tags']", "value['lines'][0]['price']", "value['at']")
    assert caught.value.path == "value['tags']"
    text = str(caught.value)
    assert text.startswith("cannot serialize value['tags']: a set has no JSON form")
    assert "; value['lines'][0]['price'] = nan: NaN" in text and "; value['at']: naive" in text
    # One that is not lossy among them: the error is the general one, naming them all.
    with pytest.raises(SerializationError) as mixed:
        JsonSerializer().serialize({"raw": object(), "tags": {"x"}})
    assert not isinstance(mixed.value, LossyConversion)
    assert mixed.value.paths == ("value['raw']", "value['tags']")


def test_a_refusal_shows_one_traceback_and_no_private_class() -> None:
    with pytest.raises(SerializationError) as caught:
        JsonSerializer().serialize({"tags": {"gift"}, "ratio": float("nan")})
    shown = "".join(traceback.format_exception(caught.value))
    assert shown.count("Traceback (most recent call last)") == 1, shown
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert not re.search(r"\b_[A-Z]\w*", shown), shown  # no private class (_WouldLose)
