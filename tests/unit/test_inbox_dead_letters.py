"""Dead letters without a server: their configuration is refused at the boundary with typed
errors, and what a dead letter carries reads back as the record it stands for."""

from __future__ import annotations

import pytest

from outbox import ConfigError, InvalidTopic, Outbox
from outbox.inbox import DeadLetter, DeadLetters, Inbox, InboxRunner, NotADeadLetter, RawRecord
from outbox.inbox.config import ConsumerConfig
from outbox.inbox.dead_letter_retry import parse_coordinates
from outbox.inbox.dead_letters import _about, carried_headers


def runner(inbox: Inbox) -> InboxRunner:
    config = ConsumerConfig(database_url="postgresql://x/y", kafka={"bootstrap.servers": "b:9"})
    return InboxRunner(inbox, config)


def inbox_on(topics: list[str], letters: DeadLetters) -> Inbox:
    inbox = Inbox(group="billing", dead_letters=letters)
    inbox.add_handler(lambda message, session: None, *topics)
    return inbox


def test_the_default_dead_letter_topic_is_the_topic_with_a_suffix_unless_configured() -> None:
    letters = DeadLetters(Outbox(), topics={"payments": "billing.payments.failed"})
    assert letters.topic_for("orders") == "orders.dlq"
    assert letters.topic_for("payments") == "billing.payments.failed"
    assert DeadLetters(Outbox(), suffix="-dead").topic_for("orders") == "orders-dead"


def test_bad_dead_letter_configuration_is_refused_with_typed_errors() -> None:
    with pytest.raises(InvalidTopic):
        DeadLetters(Outbox(), topics={"orders": "orders dead"})
    with pytest.raises(InvalidTopic):
        DeadLetters(Outbox(), suffix="/dlq")
    with pytest.raises(ConfigError, match="its own dead-letter topic"):
        DeadLetters(Outbox(), topics={"orders": "orders"})
    with pytest.raises(ConfigError, match=r"outbox\.Outbox"):
        DeadLetters("postgresql://x/y")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="dead_letters must be"):
        Inbox(group="billing", dead_letters=Outbox())  # type: ignore[arg-type]


def test_the_runner_refuses_dead_letter_topics_that_cannot_work_before_it_starts() -> None:
    typo = DeadLetters(Outbox(), topics={"order": "order.failed"})
    with pytest.raises(ConfigError, match="no handler for: order"):
        runner(inbox_on(["orders"], typo))
    with pytest.raises(ConfigError, match="read by the same inbox"):
        runner(inbox_on(["orders", "orders.dlq"], DeadLetters(Outbox())))
    with pytest.raises(InvalidTopic, match="Kafka allows 249"):
        runner(inbox_on(["o" * 249], DeadLetters(Outbox())))
    runner(inbox_on(["orders"], DeadLetters(Outbox())))  # and a sound one starts


def test_a_dead_letter_reads_back_as_the_record_it_stands_for() -> None:
    record = RawRecord(
        "orders",
        2,
        41,
        b"k-7",
        b'{"n": 7}',
        (("outbox-id", b"0190f3c2-8d4e-7a31-9b2c-3f1e2d4c5b6a"), ("content-type", b"x/json")),
    )
    error = (
        "billing.Refused: amount -7 is negative\nTraceback (most recent call last):\n"
        '  File "billing.py", line 3, in on_order'
    )
    about = _about("billing", record, "0190f3c2", "handler", error, 5, 17)
    carried = carried_headers(record.headers)
    # What the relay adds to the outbox row: its own outbox-id.
    published = [*carried, *about, ("outbox-id", b"0190f3c2-0000-7000-8000-000000000000")]
    headers = dict(about)
    assert headers["dlq-error-class"] == b"billing.Refused"
    assert headers["dlq-error-message"] == b"amount -7 is negative"
    assert headers["dlq-traceback"].startswith(b"Traceback (most recent call last):\n  File")
    assert (headers["dlq-topic"], headers["dlq-partition"], headers["dlq-offset"]) == (
        b"orders",
        b"2",
        b"41",
    )
    assert (headers["dlq-key"], headers["dlq-parked-id"], headers["dlq-attempts"]) == (
        b"k-7",
        b"17",
        b"5",
    )
    assert carried[0] == ("dlq-original-outbox-id", record.headers[0][1])

    letter = DeadLetter.from_record(b"k-7", b'{"n": 7}', published)
    assert (letter.group, letter.topic, letter.partition, letter.offset) == (
        "billing",
        "orders",
        2,
        41,
    )
    assert (letter.message_id, letter.key, letter.value) == ("0190f3c2", b"k-7", b'{"n": 7}')
    assert letter.headers == record.headers  # the original names back, the letter's own id gone
    assert letter.error.startswith("billing.Refused: amount -7 is negative\nTraceback")
    assert (letter.reason, letter.value_omitted) == ("handler", False)


def test_a_record_that_is_no_dead_letter_is_refused_by_name() -> None:
    with pytest.raises(NotADeadLetter, match="no dlq-group header"):
        DeadLetter.from_record(b"k", b"v", [("content-type", b"x")])
    headers = [
        ("dlq-group", b"g"),
        ("dlq-topic", b"t"),
        ("dlq-reason", b"handler"),
        ("dlq-partition", b"x"),
        ("dlq-offset", b"1"),
    ]
    with pytest.raises(NotADeadLetter, match="integers"):
        DeadLetter.from_record(b"k", b"v", headers)


def test_dead_letter_coordinates_are_parsed_or_refused() -> None:
    assert parse_coordinates("orders.dlq:0:42") == ("orders.dlq", 0, 42)
    for bad in ("orders.dlq:0", ":0:1", "orders.dlq:a:1", "orders.dlq"):
        with pytest.raises(ConfigError, match="TOPIC:PARTITION:OFFSET"):
            parse_coordinates(bad)


def test_retry_from_a_dead_letter_refuses_bad_usage_before_touching_anything() -> None:
    from click.testing import CliRunner

    from outbox.cli import main

    base = ["inbox", "parked", "retry", "--database-url", "postgresql://u@127.0.0.1:1/x"]
    cases = [
        (["--dead-letter", "orders.dlq:0:1"], "pass --bootstrap-servers"),
        (["--dead-letter", "orders.dlq:0:1", "--all"], "give nothing else"),
        (["--dead-letter", "orders.dlq:0", "--bootstrap-servers", "b:9"], "TOPIC:PARTITION:OFFSET"),
    ]
    for args, expected in cases:
        result = CliRunner().invoke(main, [*base, *args])
        assert result.exit_code != 0 and expected in result.output, (args, result.output)
