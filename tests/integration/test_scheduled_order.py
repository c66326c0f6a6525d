"""A scheduled message's place in its key's order, on the real stack, and how the chaos
audit judges it.

The relay makes a due scheduled message pending with a new seq in a transaction of its own:
a writer of the key does not take turns with it. So when the writer's transaction is open
across the promotion (either way round), the message of the lower seq may reach the topic
second, as with two writers of one key that do not take turns; the audit must not count that
(the reverted audit, by seq alone, did). A writer that commits after the promotion did is
ordered after it, by the relay and by the immediate sender alike.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from outbox import ImmediateSender, Message, Outbox
from outbox.chaos import audit
from outbox.chaos.visibility import RECORD_MADE_PENDING
from outbox.chaos.writers import BUSINESS_TABLE, CREATE_BUSINESS_TABLE
from outbox.queries import Queries
from outbox.schema import DEFAULT_SPEC
from tests.integration.test_scheduled import promote_all
from tests.relay_helpers import owns_every_shard, relay_config, running_relay, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def audited(engine: sa.Engine) -> sa.Engine:
    """The test's database with the chaos run's business table and made-pending record."""
    with engine.begin() as conn:
        conn.execute(sa.text(CREATE_BUSINESS_TABLE))
        for statement in RECORD_MADE_PENDING:
            conn.execute(sa.text(statement))
    return engine


def write(
    ob: Outbox, conn: sa.Connection, topic: str, value: str, deliver_after: float | None = None
) -> uuid.UUID:
    """What a chaos writer's transaction does: its message, then its business row."""
    message = Message(topic, value, key="k", deliver_after=deliver_after)
    [result] = ob.publish_many(conn, [message])
    conn.execute(
        sa.text(f"INSERT INTO {BUSINESS_TABLE} (id, writer, message_ids) VALUES (:id, 0, :ids)"),
        {"id": uuid.uuid4(), "ids": [result.message_id]},
    )
    return result.message_id


def status(engine: sa.Engine, message_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        query = sa.text("SELECT status FROM outbox WHERE id = :id")
        return str(conn.execute(query, {"id": message_id}).scalar_one())


def judged(
    engine: sa.Engine, bootstrap: str, topic: str
) -> tuple[list[uuid.UUID | None], dict[uuid.UUID, audit.RowFacts], list[str], list[str], int]:
    """The topic's ids in order, the rows, the audit's violations and allowed inversions, and
    the violations the audit found by seq alone (as before it knew transactions)."""
    records = audit.read_topics(bootstrap, [topic], timeout=30)
    rows = audit.row_facts(engine, [topic])
    unordered: list[str] = []
    found = audit.order_violations(records, rows, unordered)
    bare = {m: audit.RowFacts(f.seq, f.topic, f.key) for m, f in rows.items()}
    return (
        [r.message_id for r in records],
        rows,
        found,
        unordered,
        len(audit.order_violations(records, bare)),
    )


def test_a_writer_open_across_the_promotion_may_follow_it(  # type: ignore[no-untyped-def]
    audited, outbox_url, bootstrap_servers, make_topic
) -> None:
    topic = make_topic("sched-open-writer")
    ob = Outbox(audited)
    with running_relay(relay_config(outbox_url, bootstrap_servers)) as relay:
        wait_for(lambda: owns_every_shard(relay), 30, "the relay to own its shards")
        with audited.begin() as conn:
            due = write(ob, conn, topic, "due", deliver_after=1.5)
        # The key's writer writes its next message (the lower seq) before the promotion and
        # commits after the relay sent the promoted one.
        with audited.connect() as conn, conn.begin():
            open_one = write(ob, conn, topic, "open")
            wait_for(lambda: status(audited, due) == "sent", 15, "the due message to go")
        wait_for(lambda: status(audited, open_one) == "sent", 15, "the writer's message")
    order, rows, found, unordered, by_seq_alone = judged(audited, bootstrap_servers, topic)
    assert order == [due, open_one] and rows[open_one].seq < rows[due].seq
    assert found == [] and len(unordered) == 1
    assert by_seq_alone == 1  # what the audit reported before


def test_a_writer_that_commits_while_the_promotion_is_open_may_precede_it(  # type: ignore[no-untyped-def]
    audited, outbox_url, bootstrap_servers, make_topic
) -> None:
    topic = make_topic("sched-open-promotion")
    ob = Outbox(audited)
    with audited.begin() as conn:
        due = write(ob, conn, topic, "due", deliver_after=3600)
    with running_relay(relay_config(outbox_url, bootstrap_servers)) as relay:
        wait_for(lambda: owns_every_shard(relay), 30, "the relay to own its shards")
        # A promotion (the relay's own statement) takes its seq, and has not committed when
        # the key's writer writes and commits the next message (the higher seq).
        with audited.connect() as conn, conn.begin():
            conn.execute(
                sa.text("UPDATE outbox SET deliver_at = now() WHERE id = :id"), {"id": due}
            )
            conn.execute(Queries(DEFAULT_SPEC)["promote_scheduled"], {"id": due})
            with audited.begin() as writer:
                later = write(ob, writer, topic, "later")
            wait_for(lambda: status(audited, later) == "sent", 15, "the writer's message")
        wait_for(lambda: status(audited, due) == "sent", 15, "the promoted message")
    order, rows, found, unordered, by_seq_alone = judged(audited, bootstrap_servers, topic)
    assert order == [later, due] and rows[due].seq < rows[later].seq
    assert found == [] and len(unordered) == 1
    assert by_seq_alone == 1


def test_a_message_written_after_the_promotion_follows_it_even_sent_at_once(  # type: ignore[no-untyped-def]
    audited, outbox_url, bootstrap_servers, make_topic
) -> None:
    topic = make_topic("sched-after")
    with audited.begin() as conn:
        due = write(Outbox(audited), conn, topic, "due", deliver_after=3600)
    with audited.begin() as conn:
        conn.execute(sa.text("UPDATE outbox SET deliver_at = now() WHERE id = :id"), {"id": due})
    assert promote_all(DEFAULT_SPEC, outbox_url) == 1  # pending, no relay to send it yet
    immediate = ImmediateSender(audited, {"bootstrap.servers": bootstrap_servers})
    try:
        with Outbox(audited, immediate=immediate).transaction() as tx:
            later = tx.publish(topic, "later", key="k").message_id
        assert immediate.flush(30)
    finally:
        immediate.close(10)
    assert status(audited, later) == "pending"  # left to the relay: behind the promoted one
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: status(audited, later) == "sent", 30, "the relay to send both")
    order, _, found, unordered, by_seq_alone = judged(audited, bootstrap_servers, topic)
    assert order == [due, later]
    assert found == unordered == [] and by_seq_alone == 0
