"""The inbox's pure parts: declaring handlers, identifying and decoding records, settings."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest

from outbox.errors import ConfigError, InvalidTopic
from outbox.inbox import (
    BY_OFFSET,
    ConsumerConfig,
    Inbox,
    InboxTableSpec,
    JsonDeserializer,
    RawRecord,
    UndecodableValue,
    load_inbox,
)
from outbox.inbox.api import MissingIdentity
from outbox.inbox.apply import prepare
from outbox.inbox.config import kafka_config_from_env

ID = uuid.UUID("0192a3b4-0000-7000-8000-000000000001")


def record(headers: tuple[tuple[str, bytes | None], ...] = (), value: bytes | None = b"{}"):  # type: ignore[no-untyped-def]
    return RawRecord("orders", 2, 41, b"k", value, headers)


def handler(message, session) -> None:  # type: ignore[no-untyped-def]
    pass


async def async_handler(message, session) -> None:  # type: ignore[no-untyped-def]
    pass


def test_handlers_are_declared_per_topic() -> None:
    inbox = Inbox("billing")
    inbox.handler("orders", "payments")(handler)
    assert inbox.topics == ["orders", "payments"]
    assert not inbox.is_async


@pytest.mark.parametrize(
    ("topic", "error"),
    [("bad topic", InvalidTopic), ("", InvalidTopic), (7, InvalidTopic)],
)
def test_bad_topic_names_are_refused(topic: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        Inbox("billing").add_handler(handler, topic)  # type: ignore[arg-type]


def test_bad_declarations_are_refused() -> None:
    inbox = Inbox("billing")
    with pytest.raises(ConfigError, match="callable"):
        inbox.add_handler("not a function", "orders")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least one topic"):
        inbox.add_handler(handler)
    inbox.add_handler(handler, "orders")
    with pytest.raises(ConfigError, match="already has a handler"):
        inbox.add_handler(handler, "orders")
    with pytest.raises(ConfigError, match="all sync or all async"):
        inbox.add_handler(async_handler, "payments")
    with pytest.raises(ConfigError, match="group"):
        Inbox("")
    with pytest.raises(ConfigError, match="missing_id"):
        Inbox("billing", missing_id="guess")
    with pytest.raises(ConfigError, match="deserialize"):
        Inbox("billing", deserializer=object())  # type: ignore[arg-type]


def batch_handler(messages, session) -> None:  # type: ignore[no-untyped-def]
    pass


def test_batch_handlers_are_declared_per_topic_next_to_plain_ones() -> None:
    inbox = Inbox("billing")
    inbox.handler("orders")(handler)
    inbox.batch_handler("payments", "refunds")(batch_handler)
    assert inbox.topics == ["orders", "payments", "refunds"]
    assert [inbox.takes_batches(t) for t in inbox.topics] == [False, True, True]
    with pytest.raises(ConfigError, match="already has a handler"):
        inbox.add_batch_handler(batch_handler, "orders")
    with pytest.raises(ConfigError, match="all sync or all async"):
        inbox.add_batch_handler(async_handler, "invoices")
    with pytest.raises(InvalidTopic):
        inbox.add_batch_handler(batch_handler, "bad topic")


def test_identity_is_the_outbox_id_header_in_canonical_form() -> None:
    inbox = Inbox("billing")
    upper = str(ID).upper().encode()
    assert inbox.identify(record((("outbox-id", upper),))) == str(ID)


def test_records_without_an_id_are_parked_by_default_or_identified_as_configured() -> None:
    with pytest.raises(MissingIdentity):
        Inbox("billing").identify(record())
    with pytest.raises(MissingIdentity, match="not a UUID"):
        Inbox("billing").identify(record((("outbox-id", b"nope"),)))
    assert Inbox("b", missing_id=BY_OFFSET).identify(record()) == "orders/2/41"
    by_key = Inbox("b", missing_id=lambda r: r.key.decode() if r.key else None)
    assert by_key.identify(record()) == "k"
    assert Inbox("b", id_header="event-id").identify(record((("event-id", b"e-1"),))) == "e-1"


def test_values_are_decoded_by_content_type() -> None:
    d = JsonDeserializer()
    assert d.deserialize(b'{"total": "19.90"}', "application/json") == {"total": "19.90"}
    assert d.deserialize(b"hello", "text/plain; charset=utf-8") == "hello"
    assert d.deserialize(b"\x00raw", None) == b"\x00raw"
    assert d.deserialize(None, "application/json") is None
    with pytest.raises(UndecodableValue):
        d.deserialize(b"{nope", "application/json")


def test_prepare_marks_what_must_be_parked_at_once() -> None:
    inbox = Inbox("billing")
    inbox.add_handler(handler, "orders")
    json = ("content-type", b"application/json")
    good = prepare(inbox, record((("outbox-id", str(ID).encode()), json), b'{"n": 1}'))
    assert good.park is None and good.message is not None and good.message.value == {"n": 1}
    assert good.message.header("content-type") == b"application/json"
    bad = prepare(inbox, record((("outbox-id", str(ID).encode()), json), b"{"))
    assert bad.park is not None and bad.park[0] == "undecodable"
    anonymous = prepare(inbox, record((json,)))
    assert anonymous.park is not None and anonymous.park[0] == "no-identity"


def test_load_inbox_names_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match="module:attribute"):
        load_inbox("tests.inbox_app")
    with pytest.raises(ConfigError, match="cannot import"):
        load_inbox("no_such_module_here:inbox")
    with pytest.raises(ConfigError, match=r"not an outbox\.inbox\.Inbox"):
        load_inbox("tests.inbox_app:make_inbox")


def test_consumer_settings_are_validated() -> None:
    ok = {"database_url": "postgresql+psycopg://x/y", "kafka": {"bootstrap.servers": "b:9092"}}
    ConsumerConfig(**ok)  # type: ignore[arg-type]
    bad: list[dict[str, object]] = [
        {"kafka": {}},
        {"kafka": {"bootstrap.servers": "b", "enable.auto.commit": True}},
        {"kafka": {"bootstrap.servers": "b", "isolation.level": "read_uncommitted"}},
        {"kafka": {"bootstrap.servers": "b", "group.id": "x"}},
        {"batch_size": 0},
        {"max_attempts": 0},
        {"backoff_base": 2.0, "backoff_max": 1.0},
        {"retention": timedelta(0)},
        {"metrics_port": 70000},
    ]
    for change in bad:
        with pytest.raises(ConfigError):
            ConsumerConfig(**{**ok, **change})  # type: ignore[arg-type]


def test_table_names_are_plain_identifiers() -> None:
    assert InboxTableSpec("billing", "inbox").parked_name == "inbox_parked"
    with pytest.raises(ConfigError):
        InboxTableSpec("billing", "Inbox; DROP")


def test_kafka_settings_come_from_the_environment_like_the_relays() -> None:
    env = {"OUTBOX_KAFKA_SASL_PASSWORD": "pw", "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": "b:9092"}
    assert kafka_config_from_env(env) == {"sasl.password": "pw"}


def test_kafka_counts_as_out_of_reach_while_a_commit_blocks_past_the_limit() -> None:
    """A synchronous offset commit waits as long as the group coordinator is down, and the
    client's error callbacks wait with it: the health must not keep saying Kafka is fine."""
    import time

    from outbox.inbox.metrics import KAFKA_CALL_LIMIT, InboxHealth

    health = InboxHealth()
    health.subscribed = True
    health.kafka_ok = True
    health.database_ok = True
    health.kafka_call_since = time.monotonic()
    assert health.kafka_ok and health.ready  # a commit in progress, not for long yet
    health.kafka_call_since = time.monotonic() - KAFKA_CALL_LIMIT - 0.1
    assert not health.kafka_ok and not health.ready
    assert "Kafka out of reach" in health.not_ready_because()
    health.kafka_call_since = None
    assert health.kafka_ok


def test_readyz_names_only_what_is_out_of_reach() -> None:
    from outbox.inbox.metrics import InboxHealth

    health = InboxHealth()
    # Waiting for the database at start: Kafka was never asked, so it is not blamed.
    assert health.not_ready_because() == "database out of reach, not subscribed yet"
    health.database_ok = True
    health.subscribed = True
    assert health.not_ready_because() == "joining the consumer group"
    health.kafka_ok = True  # partitions assigned
    assert health.ready
    health.kafka_ok = False  # all brokers down
    assert health.not_ready_because() == "Kafka out of reach"


@pytest.mark.parametrize("kind", ["inbox", "checkback"])
def test_healthz_turns_unhealthy_once_the_database_is_out_of_reach_past_the_limit(
    kind: str,
) -> None:
    import time

    from outbox.inbox.metrics import InboxHealth
    from outbox.prepared.metrics import CheckbackHealth

    limit = 0.2
    health: Any = (
        InboxHealth(database_outage_limit=limit)
        if kind == "inbox"
        else CheckbackHealth(stale_after=60, max_hung=4, database_outage_limit=limit)
    )
    assert health.alive  # never reached yet, not for long
    time.sleep(limit + 0.05)
    assert not health.alive  # never reached since the start, past the limit
    assert health.not_alive_because().startswith("database out of reach for ")
    health.database_ok = True
    assert health.alive
    health.database_ok = False
    health.database_ok = False  # still down: the outage counts from its first moment
    assert health.alive
    time.sleep(limit + 0.05)
    assert not health.alive
