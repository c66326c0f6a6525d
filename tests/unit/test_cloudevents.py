"""The CloudEvents envelope's pure parts: the headers and values it builds, what it refuses
before anything is written, and the identity the inbox reads from a CloudEvent record."""

from __future__ import annotations

import base64
import datetime as dt
import uuid
from typing import Any

import orjson
import pytest
from cloudevents.core.formats.json import JSONFormat

from outbox import ConfigError, Outbox
from outbox.cloudevents import (
    STRUCTURED_CONTENT_TYPE,
    CloudEvents,
    format_time,
    record_identity,
)
from outbox.errors import InvalidCloudEvent, InvalidHeaders, PayloadTooLarge, SerializationError
from outbox.inbox import Inbox, RawRecord
from outbox.inbox.api import MissingIdentity
from outbox.message import EncodedMessage, Message, encode_message
from outbox.serialization import JsonSerializer

ORDERS = CloudEvents(source="/shop/orders", types={"orders": "com.example.order.placed"})
STRUCTURED = CloudEvents(
    source="/shop/orders", types={"orders": "com.example.order"}, mode="structured"
)


def encode(message: Message, envelope: CloudEvents | None = ORDERS, limit: int = 1_000_000) -> Any:
    return encode_message(message, JsonSerializer(), limit, (), envelope)


def headers_of(encoded: EncodedMessage) -> dict[str, bytes]:
    row = encoded.row
    return dict(zip(row.get("header_names", []), row.get("header_values", []), strict=True))


def test_binary_mode_writes_every_attribute_as_a_ce_header_and_keeps_the_value() -> None:
    before = dt.datetime.now(dt.UTC)
    encoded = encode(Message("orders", {"id": 7}, key=7, headers={"tenant": "eu"}, subject="7"))
    after = dt.datetime.now(dt.UTC)
    headers = headers_of(encoded)
    assert list(headers) == [
        "ce_specversion",
        "ce_id",
        "ce_source",
        "ce_type",
        "ce_time",
        "ce_subject",
        "tenant",
    ]
    assert headers["ce_specversion"] == b"1.0"
    assert headers["ce_id"] == str(encoded.id).encode()
    assert headers["ce_source"] == b"/shop/orders"
    assert headers["ce_type"] == b"com.example.order.placed"
    assert headers["ce_subject"] == b"7"
    assert headers["tenant"] == b"eu"
    time = headers["ce_time"].decode()
    assert time.endswith("Z")
    assert before <= dt.datetime.fromisoformat(time) <= after
    # The data and its content type (the relay's content-type header) are untouched.
    assert encoded.row["value"] == b'{"id":7}'
    assert encoded.row["content_type"] == "application/json"


def test_the_type_given_to_publish_wins_over_the_topic_default() -> None:
    encoded = encode(Message("orders", {"id": 7}, type="com.example.order.cancelled"))
    assert headers_of(encoded)["ce_type"] == b"com.example.order.cancelled"
    assert "ce_subject" not in headers_of(encoded)


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (Message("payments", {"id": 7}), "no CloudEvents type for a message to 'payments'"),
        (Message("orders", {"id": 7}, type=""), "type must not be empty"),
        (Message("orders", {"id": 7}, type="  "), "type must not be empty"),
        (Message("orders", {"id": 7}, type=b"x"), "type must be a str, got bytes"),  # type: ignore[arg-type]
        (Message("orders", {"id": 7}, type="a\nb"), "control character"),
        (Message("orders", {"id": 7}, subject=""), "subject must not be empty"),
        (Message("orders", {"id": 7}, subject=7), "subject must be a str, got int"),  # type: ignore[arg-type]
    ],
)
def test_missing_or_bad_attributes_are_refused(message: Message, match: str) -> None:
    with pytest.raises(InvalidCloudEvent, match=match):
        encode(message)


@pytest.mark.parametrize("name", ["ce_id", "CE_Type", "ce_partitionkey", "content-type"])
def test_a_user_header_the_envelope_writes_itself_is_refused(name: str) -> None:
    with pytest.raises(InvalidHeaders, match="clashes with the CloudEvents envelope"):
        encode(Message("orders", {"id": 7}, headers={name: "x"}))
    with pytest.raises(InvalidHeaders, match="clashes"):
        encode(Message("orders", {"id": 7}, headers={name: "x"}), STRUCTURED)


def test_without_an_envelope_ce_attributes_are_refused_and_ce_headers_are_the_users() -> None:
    with pytest.raises(InvalidCloudEvent, match="need an outbox made with envelope"):
        encode(Message("orders", {"id": 7}, type="com.example.order"), None)
    with pytest.raises(InvalidCloudEvent, match="need an outbox made with envelope"):
        encode(Message("orders", {"id": 7}, subject="7"), None)
    plain = encode(Message("orders", {"id": 7}, headers={"ce_id": "mine"}), None)
    assert headers_of(plain) == {"ce_id": b"mine"}


def test_the_size_limit_counts_the_envelope() -> None:
    message = Message("orders", b"v" * 100)
    encode(message, None, limit=120)
    with pytest.raises(PayloadTooLarge):
        encode(message, ORDERS, limit=120)
    with pytest.raises(PayloadTooLarge):
        encode(message, STRUCTURED, limit=120)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"source": ""}, "source must not be empty"),
        ({"source": "/shop orders"}, "not a URI reference"),
        ({"source": None}, "source must be a str"),
        ({"source": "/s", "types": {"bad topic": "t"}}, "Kafka does not allow"),
        ({"source": "/s", "types": {"orders": ""}}, "type must not be empty"),
        ({"source": "/s", "types": ["orders"]}, "types must map topics"),
        ({"source": "/s", "mode": "batched"}, "mode must be 'binary' or 'structured'"),
    ],
)
def test_bad_settings_are_config_errors(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CloudEvents(**settings)


def test_outbox_takes_only_a_cloudevents_envelope() -> None:
    with pytest.raises(ConfigError, match="envelope must be"):
        Outbox(envelope="cloudevents")  # type: ignore[arg-type]
    assert Outbox(envelope=ORDERS).envelope is ORDERS


def test_the_types_cannot_change_after_the_checks() -> None:
    types = {"orders": "com.example.order"}
    envelope = CloudEvents(source="/s", types=types)
    types["orders"] = ""
    assert envelope.type_for("orders", None) == "com.example.order"


def read_structured(encoded: EncodedMessage) -> Any:
    """The event as the CloudEvents SDK's JSON format reads it."""
    assert encoded.row["content_type"] == STRUCTURED_CONTENT_TYPE
    assert "header_names" not in encoded.row  # no ce_ headers: consumers would take it as binary
    return JSONFormat().read(None, encoded.row["value"])


def test_structured_mode_embeds_json_data_as_json() -> None:
    encoded = encode(Message("orders", {"id": 7, "lines": [1, 2]}, subject="7"), STRUCTURED)
    event = read_structured(encoded)
    assert event.get_id() == str(encoded.id)
    assert event.get_source() == "/shop/orders"
    assert event.get_type() == "com.example.order"
    assert event.get_specversion() == "1.0"
    assert event.get_subject() == "7"
    assert event.get_datacontenttype() == "application/json"
    assert event.get_data() == {"id": 7, "lines": [1, 2]}
    assert orjson.loads(encoded.row["value"])["data"] == {"id": 7, "lines": [1, 2]}


def test_structured_mode_writes_text_as_a_string_and_bytes_as_base64() -> None:
    text = orjson.loads(encode(Message("orders", "hello"), STRUCTURED).row["value"])
    assert text["data"] == "hello"
    assert text["datacontenttype"] == "text/plain; charset=utf-8"
    raw = orjson.loads(encode(Message("orders", b"\x00\xff"), STRUCTURED).row["value"])
    assert base64.b64decode(raw["data_base64"]) == b"\x00\xff"
    assert "data" not in raw and "datacontenttype" not in raw
    empty = orjson.loads(encode(Message("orders", None, key="k"), STRUCTURED).row["value"])
    assert "data" not in empty and "data_base64" not in empty


def test_structured_mode_refuses_json_data_that_does_not_parse() -> None:
    class Lying:
        content_type = "application/json"

        def serialize(self, value: object) -> bytes:
            return b"{not json"

    with pytest.raises(SerializationError, match="not JSON"):
        encode_message(Message("orders", {"a": 1}), Lying(), 1_000_000, (), STRUCTURED)


def test_time_is_rfc3339_in_utc() -> None:
    paris = dt.timezone(dt.timedelta(hours=1))
    assert format_time(dt.datetime(2026, 1, 2, 4, 5, 6, 7, tzinfo=paris)) == (
        "2026-01-02T03:05:06.000007Z"
    )
    with pytest.raises(InvalidCloudEvent, match="no time zone"):
        format_time(dt.datetime(2026, 1, 2))


def test_record_identity_of_binary_and_structured_records() -> None:
    message_id = uuid.uuid4()
    upper = [("ce_id", str(message_id).upper().encode()), ("ce_source", b"/s")]
    assert record_identity(upper, None) == str(message_id)  # the outbox-id's spelling
    other = [("ce_source", b"/billing"), ("ce_id", b"invoice-1")]
    assert record_identity(other, None) == "/billing invoice-1"  # unique only per source
    structured = orjson.dumps({"id": "A-1", "source": "/erp", "specversion": "1.0"})
    ct = [("content-type", b"application/cloudevents+json; charset=utf-8")]
    assert record_identity(ct, structured) == "/erp A-1"
    assert record_identity(ct, b"[]") is None
    assert record_identity(ct, b"{oops") is None
    assert record_identity([("content-type", b"application/json")], structured) is None
    assert record_identity([], None) is None


def raw(headers: list[tuple[str, bytes | None]]) -> RawRecord:
    return RawRecord("orders", 0, 5, None, b"{}", tuple(headers))


def test_the_inbox_takes_ce_id_when_the_outbox_id_is_absent() -> None:
    inbox = Inbox("billing")
    outbox_id, ce_id = uuid.uuid4(), uuid.uuid4()
    both = [("outbox-id", str(outbox_id).encode()), ("ce_id", str(ce_id).encode())]
    assert inbox.identify(raw(both)) == str(outbox_id)
    assert inbox.identify(raw([("ce_id", str(ce_id).encode())])) == str(ce_id)
    with pytest.raises(MissingIdentity):
        inbox.identify(raw([("ce_source", b"/s")]))
