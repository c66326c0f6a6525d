"""The consuming service of a chaos run: ``outbox consume outbox.chaos.service:inbox``.

A second service with a database of its own. Its handler records every application of a
message as one row of ``chaos_applied``, through the inbox. That table is deliberately not
deduplicated: a message applied twice leaves two rows, and the audit counts them. Each row
also takes the next number of a counter per (topic, key), updated in the same transaction;
the counter's row lock orders two transactions applying one key, so the numbers are the
order in which the key's applications committed, and the audit compares it with the
writers' order.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox.chaos.writers import TOPICS
from outbox.inbox import Inbox, InboxMessage, install

#: The consumer group of the service's consumers.
GROUP = "chaos-service"
APPLIED_TABLE = "chaos_applied"
KEY_COUNTER_TABLE = "chaos_applied_keys"

CREATE_TABLES = f"""
CREATE TABLE IF NOT EXISTS {APPLIED_TABLE} (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id uuid NOT NULL,
    topic text NOT NULL,
    key text NOT NULL,
    n bigint NOT NULL,
    key_seq bigint NOT NULL,
    kafka_partition int NOT NULL,
    kafka_offset bigint NOT NULL,
    backend_pid int NOT NULL DEFAULT pg_backend_pid(),
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS {KEY_COUNTER_TABLE} (
    topic text NOT NULL,
    key text NOT NULL,
    applied bigint NOT NULL,
    PRIMARY KEY (topic, key)
);
"""

_NEXT_KEY_SEQ = sa.text(
    f"INSERT INTO {KEY_COUNTER_TABLE} AS c (topic, key, applied) VALUES (:topic, :key, 1)"
    " ON CONFLICT (topic, key) DO UPDATE SET applied = c.applied + 1 RETURNING applied"
)
_RECORD = sa.text(
    f"INSERT INTO {APPLIED_TABLE}"
    " (message_id, topic, key, n, key_seq, kafka_partition, kafka_offset)"
    " VALUES (:id, :topic, :key, :n, :key_seq, :partition, :offset)"
)

inbox = Inbox(group=GROUP)


@inbox.handler(*TOPICS)
def apply(message: InboxMessage, session: Session) -> None:
    key = message.key.decode() if message.key is not None else ""
    key_seq = session.execute(_NEXT_KEY_SEQ, {"topic": message.topic, "key": key}).scalar_one()
    session.execute(
        _RECORD,
        {
            "id": message.id,
            "topic": message.topic,
            "key": key,
            "n": message.value["n"],
            "key_seq": key_seq,
            "partition": message.partition,
            "offset": message.offset,
        },
    )


def prepare_database(database_url: str) -> None:
    """The inbox tables (through their migrations) and the service's own tables."""
    install(database_url)
    engine = sa.create_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(CREATE_TABLES)
    finally:
        engine.dispose()
