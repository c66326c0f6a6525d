"""Dead letters on the real stack: a parked record also reaches its dead-letter topic, with
where it came from and why, through the consumer's own outbox and relay; the parked row and
its dead letter commit together or not at all (a consumer killed between the two leaves
neither); a parked message is retried from its row or from its dead letter, also after the
row was purged, and applied once; a consumer whose dead letters cannot be written does not
start."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from confluent_kafka import Consumer, TopicPartition

from outbox import Outbox, OutboxTableMissing, PermissionDenied
from outbox.cli import main
from outbox.devstack.topics import create_topics
from outbox.inbox import DeadLetters, Inbox, InboxMessage, InboxRunner
from outbox.inbox.dead_letter_retry import DeadLetter
from tests import inbox_app
from tests.inbox_helpers import (
    assert_exactly_once,
    consumer_config,
    ledger_count,
    prepare_database,
    produce,
    running_consumer,
    start_consumer_process,
)
from tests.relay_helpers import relay_config, running_relay, stop_process, wait_for

pytestmark = pytest.mark.integration

INBOX_DEAD_LETTER_APP = "tests.inbox_dead_letter_app:inbox"


@pytest.fixture
def inbox_engine(outbox_url: str) -> Iterator[sa.Engine]:
    engine = prepare_database(outbox_url)
    yield engine
    engine.dispose()


@pytest.fixture
def topic_with_dead_letters(
    bootstrap_servers: str, make_topic: Callable[..., str]
) -> Iterator[tuple[str, str]]:
    """A topic and its dead-letter topic (``<topic>.dlq``), deleted afterwards."""
    from confluent_kafka.admin import AdminClient

    topic = make_topic("inbox-dlq")
    dead_letter_topic = f"{topic}.dlq"
    create_topics(bootstrap_servers, [dead_letter_topic], 1)
    yield topic, dead_letter_topic
    AdminClient({"bootstrap.servers": bootstrap_servers}).delete_topics([dead_letter_topic])


def group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def plan_failures(engine: sa.Engine, n: int, failures: int) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM fail_plan WHERE n = :n"), {"n": n})
        if failures:
            conn.execute(sa.text("INSERT INTO fail_plan VALUES (:n, :f)"), {"n": n, "f": failures})


def parked_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM inbox_parked ORDER BY id")).all())


def letter_rows(engine: sa.Engine, dead_letter_topic: str) -> list[Any]:
    """The dead letters in the consumer's outbox table (sent or not)."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT * FROM outbox WHERE topic = :t ORDER BY seq"),
                {"t": dead_letter_topic},
            ).all()
        )


def read_topic(bootstrap: str, topic: str, count: int, timeout: float = 60) -> list[Any]:
    """At least ``count`` records of ``topic``'s partition 0, from its start."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    records: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(records) < count and time.monotonic() < deadline:
            record = consumer.poll(0.5)
            if record is not None and record.error() is None:
                records.append(record)
    finally:
        consumer.close()
    assert len(records) >= count, f"{len(records)} of {count} records on {topic}"
    return records


def cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_a_parked_record_reaches_its_dead_letter_topic_with_its_origin_and_error(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    topic_with_dead_letters: tuple[str, str],
) -> None:
    topic, dead_letter_topic = topic_with_dead_letters
    plan_failures(inbox_engine, 7, 100)
    [message_id] = produce(bootstrap_servers, topic, [7], extra={7: {"fail": True}}).values()
    name = group()
    inbox = inbox_app.make_inbox([topic], name, dead_letters=DeadLetters(Outbox()))
    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=2)
    with running_consumer(inbox, config):
        wait_for(lambda: len(parked_rows(inbox_engine)) == 1, 60, "parked")
        [parked] = parked_rows(inbox_engine)
        # Written with the parked row, before any relay ran.
        [row] = letter_rows(inbox_engine, dead_letter_topic)
        assert row.status == "pending"
        with running_relay(relay_config(outbox_url, bootstrap_servers)):
            [record] = read_topic(bootstrap_servers, dead_letter_topic, 1)
        headers = dict(record.headers())
        assert (record.key(), record.value()) == (b"key-7", parked.value)
        assert headers["dlq-group"] == name.encode()
        assert (headers["dlq-topic"], headers["dlq-partition"], headers["dlq-offset"]) == (
            topic.encode(),
            b"0",
            b"0",
        )
        assert headers["dlq-key"] == b"key-7"
        assert headers["dlq-message-id"] == str(message_id).encode()
        assert headers["dlq-reason"] == b"handler"
        assert headers["dlq-error-class"] == b"tests.inbox_app.PlannedFailure"
        assert headers["dlq-error-message"] == b"planned failure of n=7"
        assert b"in fail_if_planned" in headers["dlq-traceback"]
        assert (headers["dlq-attempts"], headers["dlq-parked-id"]) == (
            b"2",
            str(parked.id).encode(),
        )
        # The record's own headers go along, its outbox-id under another name (the dead
        # letter has its own).
        assert headers["dlq-original-outbox-id"] == str(message_id).encode()
        assert headers["content-type"] == b"application/json"
        assert headers["outbox-id"] == str(row.id).encode()

        # Fixed and retried from the parked table: applied once; the dead letter stays.
        plan_failures(inbox_engine, 7, 0)
        assert "requeued 1" in cli(
            "inbox", "parked", "retry", str(parked.id), "--database-url", outbox_url
        )
        wait_for(lambda: parked_rows(inbox_engine) == [], 30, "applied on retry")
    assert_exactly_once(inbox_engine, [7])
    assert len(letter_rows(inbox_engine, dead_letter_topic)) == 1
    assert len(read_topic(bootstrap_servers, dead_letter_topic, 1)) == 1


def test_a_message_is_retried_from_its_dead_letter_also_after_its_row_was_purged(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    topic_with_dead_letters: tuple[str, str],
) -> None:
    topic, dead_letter_topic = topic_with_dead_letters
    plan_failures(inbox_engine, 7, 100)
    produce(bootstrap_servers, topic, [7], extra={7: {"fail": True}})
    inbox = inbox_app.make_inbox([topic], group(), dead_letters=DeadLetters(Outbox()))
    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=1)
    database = ("--database-url", outbox_url)
    kafka = ("--bootstrap-servers", bootstrap_servers)

    def retry_from(offset: int) -> str:
        place = f"{dead_letter_topic}:0:{offset}"
        return cli("inbox", "parked", "retry", "--dead-letter", place, *database, *kafka)

    with (
        running_consumer(inbox, config),
        running_relay(relay_config(outbox_url, bootstrap_servers)),
    ):
        wait_for(lambda: len(parked_rows(inbox_engine)) == 1, 60, "parked")
        read_topic(bootstrap_servers, dead_letter_topic, 1)

        # Retried from the dead letter while its row is there, and failing again: parked
        # again, with a second dead letter.
        assert "requeued 1 parked message(s), 0 put back" in retry_from(0)
        wait_for(lambda: parked_rows(inbox_engine)[0].attempts == 2, 30, "parked again")
        second = DeadLetter.from_record(
            *_parts(read_topic(bootstrap_servers, dead_letter_topic, 2)[1])
        )
        assert (second.offset, second.error.split("\n")[0]) == (
            0,
            "tests.inbox_app.PlannedFailure: planned failure of n=7",
        )

        # Purged, fixed, retried from its dead letter: put back, applied once.
        assert "deleted 1" in cli("inbox", "parked", "purge", "--all", *database)
        plan_failures(inbox_engine, 7, 0)
        assert "1 put back" in retry_from(1)
        wait_for(lambda: ledger_count(inbox_engine) == 1, 30, "applied from the dead letter")
        wait_for(lambda: parked_rows(inbox_engine) == [], 30, "the put-back row gone")

        # The first dead letter, retried once more: put back, found applied, removed.
        assert "1 put back" in retry_from(0)
        wait_for(lambda: parked_rows(inbox_engine) == [], 30, "the duplicate removed")
    assert_exactly_once(inbox_engine, [7])


def _parts(record: Any) -> tuple[Any, Any, Any]:
    return record.key(), record.value(), record.headers()


def test_a_consumer_killed_while_parking_leaves_neither_the_row_nor_its_dead_letter(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    topic_with_dead_letters: tuple[str, str],
    tmp_path: Path,
) -> None:
    topic, dead_letter_topic = topic_with_dead_letters
    plan_failures(inbox_engine, 7, 100)
    produce(bootstrap_servers, topic, [7], extra={7: {"fail": True}})
    # The dead letter's insert stalls once the parked row is written (this transaction
    # sees its own row): the consumer is killed right there, between the two writes.
    with inbox_engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE FUNCTION stall_dead_letter() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN IF right(NEW.topic, 4) = '.dlq' AND EXISTS (SELECT FROM inbox_parked)"
            " THEN PERFORM pg_sleep(10); END IF; RETURN NEW; END $$;"
            " CREATE TRIGGER stall_dead_letter BEFORE INSERT ON outbox"
            " FOR EACH ROW EXECUTE FUNCTION stall_dead_letter()"
        )
    name, log = group(), tmp_path / "consumer.log"
    # Short sessions: the restarted consumer need not wait out the killed one's.
    args = (
        "--max-attempts",
        "1",
        "-X",
        "session.timeout.ms=6000",
        "-X",
        "heartbeat.interval.ms=500",
    )
    process = start_consumer_process(
        outbox_url, bootstrap_servers, [topic], name, *args, log=log, target=INBOX_DEAD_LETTER_APP
    )
    wait_for(lambda: stalled_backends(inbox_engine) == 1, 60, "the dead letter's insert")
    process.kill()  # SIGKILL, the parked row written, its dead letter being written
    process.wait(10)
    # The cut transaction ends when its backend finds the client gone, after the stall.
    wait_for(lambda: stalled_backends(inbox_engine) == 0, 30, "the cut transaction to end")
    assert (len(parked_rows(inbox_engine)), len(letter_rows(inbox_engine, dead_letter_topic))) == (
        0,
        0,
    )

    with inbox_engine.begin() as conn:
        conn.exec_driver_sql("DROP TRIGGER stall_dead_letter ON outbox")
    process = start_consumer_process(
        outbox_url, bootstrap_servers, [topic], name, *args, log=log, target=INBOX_DEAD_LETTER_APP
    )
    wait_for(lambda: len(parked_rows(inbox_engine)) == 1, 60, "parked after the restart")
    assert stop_process(process) == 0
    [parked] = parked_rows(inbox_engine)
    [letter] = letter_rows(inbox_engine, dead_letter_topic)
    headers = dict(zip(letter.header_names, letter.header_values, strict=True))
    assert headers["dlq-parked-id"] == str(parked.id).encode()
    assert ledger_count(inbox_engine) == 0


def stalled_backends(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event = 'PgSleep'"
                )
            ).scalar_one()
        )


def test_a_consumer_whose_dead_letters_have_no_outbox_table_does_not_start(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    topic_with_dead_letters: tuple[str, str],
) -> None:
    topic, _ = topic_with_dead_letters
    with inbox_engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE outbox CASCADE")
    inbox = inbox_app.make_inbox([topic], group(), dead_letters=DeadLetters(Outbox()))
    runner = InboxRunner(inbox, consumer_config(outbox_url, bootstrap_servers))
    with pytest.raises(OutboxTableMissing, match="dead letters go through the outbox table"):
        runner.run()
    assert runner.metrics.processed.labels(topic)._value.get() == 0


def test_an_async_inbox_parks_with_its_dead_letter_too(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    topic_with_dead_letters: tuple[str, str],
) -> None:
    topic, dead_letter_topic = topic_with_dead_letters
    produce(bootstrap_servers, topic, [3])
    inbox = Inbox(group=group(), dead_letters=DeadLetters(Outbox()))

    @inbox.handler(topic)
    async def refuse(message: InboxMessage, session: Any) -> None:
        await session.execute(sa.text("SELECT 1"))
        raise LookupError(f"no account for n={message.value['n']}")

    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers, max_attempts=1)):
        wait_for(lambda: len(parked_rows(inbox_engine)) == 1, 60, "parked")
    [parked] = parked_rows(inbox_engine)
    [letter] = letter_rows(inbox_engine, dead_letter_topic)
    headers = dict(zip(letter.header_names, letter.header_values, strict=True))
    assert (headers["dlq-error-class"], headers["dlq-error-message"]) == (
        b"LookupError",
        b"no account for n=3",
    )
    assert headers["dlq-parked-id"] == str(parked.id).encode()
    assert (letter.key, letter.value) == (parked.key, parked.value)


def test_a_consumer_whose_role_may_not_write_dead_letters_does_not_start(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    topic_with_dead_letters: tuple[str, str],
    login_role: Callable[..., str],
) -> None:
    topic, _ = topic_with_dead_letters
    consumer_url = login_role(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON inbox, inbox_parked, ledger TO {role}",
        "GRANT SELECT ON outbox TO {role}",  # no INSERT
    )
    inbox = inbox_app.make_inbox([topic], group(), dead_letters=DeadLetters(Outbox()))
    runner = InboxRunner(inbox, consumer_config(consumer_url, bootstrap_servers))
    with pytest.raises(PermissionDenied, match="needs INSERT on it"):
        runner.run()


def test_a_dead_letter_too_large_for_the_outbox_leaves_its_value_to_the_parked_row(
    inbox_engine: sa.Engine,
) -> None:
    from sqlalchemy.orm import Session

    from outbox import OutboxError
    from outbox.inbox import InboxStore, InboxTableSpec, RawRecord

    store = InboxStore(InboxTableSpec())
    letters = DeadLetters(Outbox(max_message_bytes=2000))
    record = RawRecord("orders", 0, 5, b"k", b"x" * 1500, (("content-type", b"text/plain"),))
    error = "ValueError: no\nTraceback (most recent call last):\n" + "  frame\n" * 300
    with Session(inbox_engine) as session, session.begin():
        parked_id = store.park(session, "billing", record, "m-5", "handler", error, 5)
        assert parked_id is not None
        letters.write(session, "billing", record, "m-5", "handler", error, 5, parked_id)
    [row] = letter_rows(inbox_engine, "orders.dlq")
    headers = dict(zip(row.header_names, row.header_values, strict=True))
    assert row.value is None and headers["dlq-value-omitted"] == b"1500"
    assert "dlq-traceback" not in headers  # 2,400 characters of it would not fit either
    assert headers["dlq-error-class"] == b"ValueError"

    letter = DeadLetter.from_record(row.key, row.value, list(headers.items()))
    assert letter.value_omitted
    with inbox_engine.begin() as conn:  # the row is there: marked for retry
        assert store.requeue_dead_letter(conn, letter) is False
        assert parked_rows(inbox_engine)[0].status == "parked"  # not committed yet
    assert parked_rows(inbox_engine)[0].status == "retry"
    with inbox_engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM inbox_parked"))
    with inbox_engine.begin() as conn, pytest.raises(OutboxError, match="does not carry the value"):
        store.requeue_dead_letter(conn, letter)
