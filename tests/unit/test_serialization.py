import dataclasses
import datetime as dt
import decimal
import uuid

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


def test_json_serializer_handles_common_values() -> None:
    json = JsonSerializer()
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    assert json.serialize(b"\x00raw") == b"\x00raw"
    assert json.serialize(None) is None
    assert json.serialize("text") == b"text"
    assert json.serialize({"a": [1, 2]}) == b'{"a":[1,2]}'
    assert json.serialize(Placed(1, when)) == b'{"order_id":1,"at":"2026-01-02T03:04:05+00:00"}'
    assert json.serialize(PlacedModel(order_id=2, amount=decimal.Decimal("9.50"))) == (
        b'{"order_id":2,"amount":"9.50"}'
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
