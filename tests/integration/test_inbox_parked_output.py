"""What an operator reads of a parked message, on the real stack: `parked list` (and
`--by-reason`) show the exception's line, not the last line of its traceback; a message parked
again after `parked retry` keeps its fingerprint, says so in the consumer's log and is dated
anew."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from datetime import UTC
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox.cli import main
from outbox.inbox import Inbox, InboxMessage
from tests.inbox_helpers import consumer_config, prepare_database, produce, running_consumer
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration

EXCEPTION_LINE = "KeyError: 'customer_email'"


def send_receipt(message: InboxMessage, session: Any) -> None:
    """A handler that fails as handlers do: a key missing from the payload. (Python 3.11
    writes ``~~~~^^^^`` under the failing expression in the traceback.)"""
    payload = dict(message.value)
    payload["email"] = payload["customer_email"]


@pytest.fixture
def inbox_engine(outbox_url: str) -> Iterator[sa.Engine]:
    engine = prepare_database(outbox_url)
    yield engine
    engine.dispose()


def parked(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM inbox_parked ORDER BY id")).all())


def cli(outbox_url: str, *args: str) -> str:
    result = CliRunner().invoke(main, ["inbox", "parked", *args, "--database-url", outbox_url])
    assert result.exit_code == 0, result.output
    return result.output


def fingerprints(outbox_url: str) -> list[str]:
    """The FINGERPRINT column of `parked list --by-reason`."""
    lines = cli(outbox_url, "list", "--by-reason").splitlines()
    return [line.split()[0] for line in lines if "  handler/KeyError: " in line]


def parked_on_first_delivery(
    inbox_engine: sa.Engine, bootstrap_servers: str, make_topic: Any
) -> tuple[Inbox, str]:
    topic = make_topic("receipts")
    inbox = Inbox(group=f"g-{uuid.uuid4().hex[:8]}")
    inbox.handler(topic)(send_receipt)
    produce(bootstrap_servers, topic, [1])
    return inbox, topic


def test_parked_list_shows_the_exception_line_not_the_tracebacks_last(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic: Any
) -> None:
    inbox, _ = parked_on_first_delivery(inbox_engine, bootstrap_servers, make_topic)
    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=1)
    with running_consumer(inbox, config):
        wait_for(lambda: len(parked(inbox_engine)) == 1, 60, "the message to be parked")
    (row,) = parked(inbox_engine)
    assert "^^^^" in row.error  # the traceback's last line is a marker line
    listed = cli(outbox_url, "list")
    assert listed.splitlines()[0].endswith(f"parked  handler: {EXCEPTION_LINE}"), listed
    by_reason = cli(outbox_url, "list", "--by-reason")
    assert f"latest: {EXCEPTION_LINE}\n" in by_reason, by_reason
    assert "^^^^" not in listed + by_reason


def test_a_message_parked_again_after_a_retry_keeps_its_fingerprint(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic: Any
) -> None:
    inbox, _ = parked_on_first_delivery(inbox_engine, bootstrap_servers, make_topic)
    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=1)
    with running_consumer(inbox, config):
        wait_for(lambda: len(parked(inbox_engine)) == 1, 60, "the message to be parked")
        first = fingerprints(outbox_url)
        cli(outbox_url, "retry", "--all")
        wait_for(lambda: parked(inbox_engine)[0].attempts == 2, 60, "it to be parked again")
    (row,) = parked(inbox_engine)
    assert "in apply_requeued" in row.error  # parked again by the retry's way through
    assert len(first) == 1 and fingerprints(outbox_url) == first


def test_a_retry_that_fails_again_is_logged_and_dated_anew(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    make_topic: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    inbox, _ = parked_on_first_delivery(inbox_engine, bootstrap_servers, make_topic)
    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=1)
    with caplog.at_level(logging.INFO, "outbox.inbox"), running_consumer(inbox, config):
        wait_for(lambda: len(parked(inbox_engine)) == 1, 60, "the message to be parked")
        (before,) = parked(inbox_engine)
        time.sleep(1.1)  # a second apart: the listing shows whole seconds
        caplog.clear()
        cli(outbox_url, "retry", "--all")
        wait_for(lambda: parked(inbox_engine)[0].attempts == 2, 60, "it to be parked again")
    (after,) = parked(inbox_engine)
    warnings = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and r.__dict__.get("message_id") == before.message_id
    ]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "retry" in warnings[0].getMessage()
    assert str(warnings[0].__dict__["error"]).startswith(EXCEPTION_LINE)
    assert after.parked_at > before.parked_at
    by_reason = cli(outbox_url, "list", "--by-reason").splitlines()
    row = next(line for line in by_reason if "  handler/KeyError: " in line)
    assert f"  {after.parked_at.astimezone(UTC):%Y-%m-%d %H:%M:%S}  handler/" in row, row


def test_a_message_parked_on_its_only_attempt_is_logged(
    inbox_engine: sa.Engine,
    outbox_url: str,
    bootstrap_servers: str,
    make_topic: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # max_attempts=1: the one attempt is on the fast way through the batch.
    inbox, topic = parked_on_first_delivery(inbox_engine, bootstrap_servers, make_topic)
    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=1)
    with caplog.at_level(logging.INFO, "outbox.inbox"), running_consumer(inbox, config):
        wait_for(lambda: len(parked(inbox_engine)) == 1, 60, "the message to be parked")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "handler failed on its last attempt: message parked"
    ]
    assert warnings[0].__dict__["topic"] == topic
    assert str(warnings[0].__dict__["error"]).startswith(EXCEPTION_LINE)
