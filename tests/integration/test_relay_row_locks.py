"""Another transaction holding a row lock on a pending outbox row (an operator's ``UPDATE``, a
long ``outbox dead retry``) while the relay marks that row sent: the mark gives up waiting
after the marking sessions' lock timeout, the batch's other rows are marked, and every shard
but the locked row's goes on; the locked row is marked once the lock is gone, and never sent
twice. Real PostgreSQL, the loop's stub publisher."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.records import OutboxRecord
from outbox.relay.daemon import Relay
from tests.integration.test_relay_loop import StubPublisher, config, wait_for
from tests.relay_helpers import looping

pytestmark = pytest.mark.integration

#: Messages per transaction, each of its own key: they spread over nearly every shard.
SPREAD = 48


def publish_spread(engine: sa.Engine, wave: str) -> list[uuid.UUID]:
    with Outbox(engine).transaction() as tx:
        results = tx.publish_many(
            [Message("locks", {"n": n}, key=f"{wave}-{n}") for n in range(SPREAD)]
        )
    return [r.message_id for r in results]


def shards_of(engine: sa.Engine, ids: list[uuid.UUID]) -> dict[uuid.UUID, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, shard FROM outbox WHERE id = ANY(:ids)"), {"ids": ids}
        )
        return {row_id: shard for row_id, shard in rows}


def sent(engine: sa.Engine, ids: list[uuid.UUID]) -> set[uuid.UUID]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id FROM outbox WHERE id = ANY(:ids) AND status = 'sent'"), {"ids": ids}
        )
        return {row_id for (row_id,) in rows}


@contextmanager
def row_locked(outbox_url: str, row_id: uuid.UUID, statement: str) -> Iterator[int]:
    """``statement`` on ``row_id`` in a transaction left open for the length of the block;
    yields the backend pid of its session."""
    url = sa.make_url(outbox_url)
    with psycopg.connect(
        host=url.host, port=url.port, user=url.username, password=url.password, dbname=url.database
    ) as conn:
        conn.execute(statement, (row_id,))
        try:
            yield conn.info.backend_pid
        finally:
            conn.rollback()


LOCKS = {
    "select for update": "SELECT 1 FROM outbox WHERE id = %s FOR UPDATE",
    "uncommitted update": "UPDATE outbox SET last_error = last_error WHERE id = %s",
}


@pytest.mark.parametrize(
    ("mode", "lock"),
    [("at-least-once", "select for update"), ("exactly-once", "uncommitted update")],
)
def test_a_row_locked_by_another_transaction_holds_back_only_its_shard(  # type: ignore[no-untyped-def]
    engine, outbox_url, mode, lock, caplog
) -> None:
    """A failure of another shard's message is recorded meanwhile too: the loop waits for
    no mark that waits for the lock."""
    first = publish_spread(engine, "first")
    locked = first[0]
    stub = StubPublisher()
    failed: set[uuid.UUID] = set()
    with looping(Relay(config(outbox_url, mode=mode), publisher=stub)) as relay:
        with row_locked(outbox_url, locked, LOCKS[lock]) as holder:
            wait_for(lambda: len(stub.acked) >= SPREAD)  # the first transaction went in one go
            wait_for(lambda: relay.health.oldest_mark_or_take_over is not None)  # being marked
            marking_since = relay.health.oldest_mark_or_take_over
            locked_shard = shards_of(engine, [locked])[locked]

            def decide(record: OutboxRecord) -> str:
                if not failed and record.shard != locked_shard:
                    failed.add(record.id)  # the first one of the second transaction
                    return "retry"
                return "ack"

            stub.decide = decide
            second = publish_spread(engine, "second")
            shard = shards_of(engine, first + second)
            free = [i for i in first + second if i != locked and shard[i] != locked_shard]
            behind = [i for i in second if shard[i] == locked_shard]
            # The batch's other rows are marked, and the second transaction goes, on every
            # shard but the locked row's, while the lock is held.
            wait_for(lambda: sent(engine, free) == set(free), timeout=15)
            assert failed  # (and recorded: it went again)
            assert not sent(engine, [locked, *behind])  # its shard waits for its mark
            assert relay.metrics.marks_blocked._value.get() >= 1
            assert any(f"(pids [{holder}])" in m for m in caplog.messages)  # who holds it
            # The mark ages from its first try: a lock held long enough wedges the relay.
            assert relay.health.oldest_mark_or_take_over == marking_since
        wait_for(lambda: sent(engine, first + second) == set(first + second), timeout=15)
    sends = Counter(record.id for record in stub.acked)
    assert sends[locked] == 1  # sent once, marked once the lock was gone
    assert set(sends) == set(first + second) and max(sends.values()) == 1


def test_a_mark_waiting_for_a_row_lock_longer_than_the_wedge_timeout_turns_health_bad(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    """Tried again and again, the mark ends only when the lock goes: the relay is not
    progressing on that shard, and says so, so that a supervisor can act; it is alive again
    once the mark is made."""
    (locked,) = publish_spread(engine, "only")[:1]
    stub = StubPublisher()
    with looping(Relay(config(outbox_url, wedge_timeout=3.0), publisher=stub)) as relay:
        with row_locked(outbox_url, locked, LOCKS["uncommitted update"]):
            wait_for(lambda: not relay.health.alive, timeout=15)
            assert relay.health.not_alive_because().startswith("wedged: a mark")
            assert locked not in sent(engine, [locked])
        wait_for(lambda: relay.health.alive, timeout=15)
        assert sent(engine, [locked]) == {locked}
    assert [record.id for record in stub.acked].count(locked) == 1


def test_a_relay_stopped_while_a_row_lock_holds_its_mark_exits_within_the_shutdown_timeout(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    """Its shards wait for the mark before they are let go, for half the shutdown timeout at
    most: then the locked rows stay pending for the shards' next owner, everything else of
    the batch is marked, and the relay exits 0."""
    first = publish_spread(engine, "first")
    locked = first[0]
    stub = StubPublisher()
    relay = Relay(config(outbox_url, shutdown_timeout=6.0), publisher=stub)
    exit_codes: list[int] = []
    thread = threading.Thread(target=lambda: exit_codes.append(relay.run()), daemon=True)
    with row_locked(outbox_url, locked, LOCKS["select for update"]):
        thread.start()
        wait_for(lambda: relay.metrics.marks_blocked._value.get() >= 1)
        stopped = time.monotonic()
        relay.stop()
        thread.join(30)
        took = time.monotonic() - stopped
        assert not thread.is_alive() and exit_codes == [0]
        assert took < 6.0  # half of it waiting for the lock, then the statement in hand
        assert sent(engine, first) == set(first) - {locked}


@pytest.mark.parametrize(
    ("mode", "lock"),
    [("at-least-once", "select for update"), ("exactly-once", "uncommitted update")],
)
def test_a_failed_row_locked_by_another_transaction_holds_back_only_its_shard(  # type: ignore[no-untyped-def]
    engine, outbox_url, mode, lock
) -> None:
    """The batch's failure (a retry to record on the locked row) waits for the lock as a mark
    does: the other shards go on meanwhile, the failure is recorded once the lock is gone,
    and the row is sent once after its backoff."""
    first = publish_spread(engine, "first")
    locked = first[0]
    stub = StubPublisher()
    tries: Counter[uuid.UUID] = Counter()

    def decide(record: OutboxRecord) -> str:
        tries[record.id] += 1
        return "retry" if record.id == locked and tries[record.id] == 1 else "ack"

    stub.decide = decide
    with looping(Relay(config(outbox_url, mode=mode), publisher=stub)) as relay:
        with row_locked(outbox_url, locked, LOCKS[lock]):
            wait_for(lambda: tries[locked] == 1)
            second = publish_spread(engine, "second")
            shard = shards_of(engine, first + second)
            locked_shard = shard[locked]
            free = [i for i in second if shard[i] != locked_shard]
            # The second transaction goes on every shard but the locked row's.
            wait_for(lambda: sent(engine, free) == set(free), timeout=15)
            assert relay.metrics.marks_blocked._value.get() >= 1
            assert tries[locked] == 1  # not read again while its failure waits
        wait_for(lambda: sent(engine, first + second) == set(first + second), timeout=15)
        with engine.connect() as conn:
            attempts = conn.execute(
                sa.text("SELECT attempts FROM outbox WHERE id = :id"), {"id": locked}
            ).scalar_one()
    assert attempts == 2  # the failure was recorded, then the send
    sends = Counter(record.id for record in stub.acked)
    assert set(sends) == set(first + second) and max(sends.values()) == 1
