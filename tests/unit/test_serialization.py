import dataclasses
import datetime as dt
import decimal
import math
import re
import uuid

import orjson
import pydantic
import pytest

from outbox.errors import SerializationError
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
