"""A consuming service for the inbox tests: each message adds one row to a ledger.

The ledger has no unique constraint on purpose: a message applied twice shows up as two
rows, and the sum of amounts no longer matches. ``outbox consume tests.inbox_app:inbox``
reads its topics and group from INBOX_TEST_TOPICS / INBOX_TEST_GROUP.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox.inbox import Inbox, InboxMessage

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS ledger (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id text NOT NULL,
    topic text NOT NULL,
    key text,
    n bigint NOT NULL,
    amount bigint NOT NULL,
    kafka_partition int NOT NULL,
    kafka_offset bigint NOT NULL,
    applied_by int NOT NULL DEFAULT pg_backend_pid(),
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    pid int
);
CREATE TABLE IF NOT EXISTS fail_plan (
    n bigint PRIMARY KEY,
    failures_left int NOT NULL
);
"""

_INSERT = sa.text(
    "INSERT INTO ledger (message_id, topic, key, n, amount, kafka_partition, kafka_offset, pid)"
    " VALUES (:id, :topic, :key, :n, :amount, :partition, :offset, :pid)"
)
_FAIL = sa.text(
    "UPDATE fail_plan SET failures_left = failures_left - 1"
    " WHERE n = :n AND failures_left > 0 RETURNING failures_left"
)

#: Attempts per n, for tests that run the runner in a thread.
ATTEMPTS: dict[int, int] = {}
#: How many messages each call of a batch handler got.
BATCH_SIZES: list[int] = []
_lock = threading.Lock()


class PlannedFailure(RuntimeError):
    """The handler fails on purpose (the fail_plan table says so)."""


def apply(message: InboxMessage, session: Any) -> dict[str, Any]:
    value = message.value
    if value.get("sleep"):
        time.sleep(value["sleep"])  # a slow handler, so that faults land mid-batch
    with _lock:
        ATTEMPTS[value["n"]] = ATTEMPTS.get(value["n"], 0) + 1
    return {
        "id": message.id,
        "topic": message.topic,
        "key": message.key.decode() if message.key is not None else None,
        "n": value["n"],
        "amount": value.get("amount", value["n"]),
        "partition": message.partition,
        "offset": message.offset,
        "pid": os.getpid(),
    }


def fail_if_planned(message: InboxMessage, session: Session) -> None:
    """Raise :class:`PlannedFailure` while the fail_plan table says this n fails."""
    if not message.value.get("fail"):
        return
    n = message.value["n"]
    # The plan is decremented in its own transaction: the handler's own writes roll back
    # with its savepoint (or its batch), the plan must not.
    with session.get_bind().connect() as conn:  # type: ignore[union-attr]
        left = conn.execute(_FAIL, {"n": n}).first()
        conn.commit()
    if left is not None:
        raise PlannedFailure(f"planned failure of n={n}")


def make_inbox(topics: list[str], group: str, **options: Any) -> Inbox:
    inbox = Inbox(group=group, **options)

    @inbox.handler(*topics)
    def on_order(message: InboxMessage, session: Session) -> None:
        row = apply(message, session)
        fail_if_planned(message, session)
        session.execute(_INSERT, row)

    return inbox


def make_batch_inbox(topics: list[str], group: str) -> Inbox:
    """The same service with a batch handler: one INSERT statement per batch."""
    inbox = Inbox(group=group)

    @inbox.batch_handler(*topics)
    def on_orders(messages: list[InboxMessage], session: Session) -> None:
        BATCH_SIZES.append(len(messages))
        rows = []
        for message in messages:
            rows.append(apply(message, session))
            fail_if_planned(message, session)
        session.execute(_INSERT, rows)

    return inbox


def make_async_inbox(topics: list[str], group: str) -> Inbox:
    inbox = Inbox(group=group)

    @inbox.handler(*topics)
    async def on_order(message: InboxMessage, session: Any) -> None:
        await session.execute(_INSERT, apply(message, session))

    return inbox


def make_async_batch_inbox(topics: list[str], group: str) -> Inbox:
    inbox = Inbox(group=group)

    @inbox.batch_handler(*topics)
    async def on_orders(messages: list[InboxMessage], session: Any) -> None:
        BATCH_SIZES.append(len(messages))
        await session.execute(_INSERT, [apply(message, session) for message in messages])

    return inbox


inbox = make_inbox(
    [t for t in os.environ.get("INBOX_TEST_TOPICS", "unset").split(",") if t],
    os.environ.get("INBOX_TEST_GROUP", "inbox-tests"),
)
