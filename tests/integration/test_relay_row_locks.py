"""Another transaction holding a row lock on a pending outbox row (an operator's ``UPDATE``, a
long ``outbox dead retry``) while the relay marks that row sent: the mark gives up waiting
after the marking sessions' lock timeout, the batch's other rows are marked, and every shard
but the locked row's goes on; the locked row is marked once the lock is gone, and never sent
twice. Real PostgreSQL, the stub sender."""

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
from outbox.relay.commands import Batch
from outbox.schema import SHARD_COUNT, shard_of
from tests.relay_helpers import looping, wait_for
from tests.relay_outside import keys_in_shards
from tests.stub_sender import StubSender, stub_config, stub_relay

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


def keys_beside(shard: int, count: int, prefix: str) -> list[str]:
    """``count`` keys in shards of their own, none of them ``shard``."""
    return [
        k
        for k in keys_in_shards(SHARD_COUNT, prefix)
        if shard_of(k.encode(), uuid.UUID(int=0)) != shard
    ][:count]


def publish_keys(engine: sa.Engine, keys: list[str]) -> list[uuid.UUID]:
    """A message of each key, in one transaction."""
    with Outbox(engine).transaction() as tx:
        results = tx.publish_many([Message("locks", {"key": k}, key=k) for k in keys])
    return [r.message_id for r in results]


def attempts_of(engine: sa.Engine, row_id: uuid.UUID) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT attempts FROM outbox WHERE id = :id"), {"id": row_id}
            ).scalar_one()
        )


class SlowStub(StubSender):
    """A stub sender whose first batch with a row of one of ``slow_keys`` takes
    ``slow_latency``, and which fails the first send of each of ``failing_keys`` (retriably).

    A retriable failure is charged to its message (recorded, with a backoff) only while Kafka
    takes this relay's later batches (one sent after the failed one answered, the last answer
    under a second old): else it is taken for an outage, and the row is sent again unrecorded.
    A test that needs a failure recorded makes its batch slow (under a second) and has another
    batch sent and answered meanwhile."""

    def __init__(self, slow_latency: float = 0.6) -> None:
        super().__init__()
        self.fast = self.latency
        self.slow_latency = slow_latency
        self.slow_keys: set[bytes] = set()
        self.failing_keys: set[bytes] = set()
        self.started: set[uuid.UUID] = set()
        self.tries: Counter[uuid.UUID] = Counter()
        self.failed: set[uuid.UUID] = set()
        self.decide = self._decide

    def start(self, batch: Batch) -> None:
        slow = {record.key for record in batch.records} & self.slow_keys
        self.slow_keys -= slow
        self.latency = self.slow_latency if slow else self.fast
        self.started.update(record.id for record in batch.records)
        super().start(batch)

    def _decide(self, record: OutboxRecord) -> str:
        self.tries[record.id] += 1
        if record.key in self.failing_keys:
            self.failing_keys.discard(record.key)
            self.failed.add(record.id)
            return "retry"
        return "ack"


@pytest.mark.parametrize(
    ("mode", "lock"),
    [("at-least-once", "select for update"), ("exactly-once", "uncommitted update")],
)
def test_a_row_locked_by_another_transaction_holds_back_only_its_shard(  # type: ignore[no-untyped-def]
    engine, outbox_url, mode, lock, caplog
) -> None:
    """A failure of another shard's message is recorded meanwhile too: no record waits for
    the lock but the locked row's."""
    first = publish_spread(engine, "first")
    locked = first[0]
    stub = SlowStub()
    with looping(stub_relay(stub_config(outbox_url, mode=mode), stub)) as relay:
        with row_locked(outbox_url, locked, LOCKS[lock]) as holder:
            wait_for(lambda: len(stub.acked) >= SPREAD, 20, "the first transaction sent")
            # Its mark gave up waiting for the lock once: the oldest mark is the locked row's.
            wait_for(lambda: relay.metrics.marks_blocked._value.get() >= 1, 20, "a mark held")
            marking_since = relay.health.oldest_mark_or_take_over
            assert marking_since is not None
            locked_shard = shards_of(engine, [locked])[locked]
            # A message of another shard fails, in a batch slow enough that the second
            # transaction's are answered before it ends: the failure is charged, recorded.
            (failing_key,) = keys_beside(locked_shard, 1, "failing")
            stub.slow_keys.add(failing_key.encode())
            stub.failing_keys.add(failing_key.encode())
            (failing,) = publish_keys(engine, [failing_key])
            wait_for(lambda: failing in stub.started, 10, "the failing row's batch sent")
            second = publish_spread(engine, "second")
            everything = [*first, *second, failing]
            shard = shards_of(engine, everything)
            free = [i for i in everything if i != locked and shard[i] != locked_shard]
            behind = [i for i in second if shard[i] == locked_shard]
            # The batch's other rows are marked, and the second transaction goes, on every
            # shard but the locked row's, while the lock is held.
            wait_for(lambda: sent(engine, free) == set(free), 15, "the other shards' rows sent")
            assert stub.failed == {failing}
            assert attempts_of(engine, failing) == 2  # its failure recorded, then its send
            assert not sent(engine, [locked, *behind])  # its shard waits for its mark
            assert relay.metrics.marks_blocked._value.get() >= 1
            assert any(f"(pids [{holder}])" in m for m in caplog.messages)  # who holds it
            # The mark ages from its first try: a lock held long enough wedges the relay.
            assert relay.health.oldest_mark_or_take_over == marking_since
        wait_for(lambda: sent(engine, everything) == set(everything), 15, "all sent")
    sends = Counter(record.id for record in stub.acked)
    assert sends[locked] == 1  # sent once, marked once the lock was gone
    assert set(sends) == set(everything) and max(sends.values()) == 1


def test_a_mark_waiting_for_a_row_lock_longer_than_the_wedge_timeout_turns_health_bad(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    """Tried again and again, the mark ends only when the lock goes: the relay is not
    progressing on that shard, and says so, so that a supervisor can act; it is alive again
    once the mark is made."""
    (locked,) = publish_spread(engine, "only")[:1]
    stub = StubSender()
    with looping(stub_relay(stub_config(outbox_url, wedge_timeout=3.0), stub)) as relay:
        with row_locked(outbox_url, locked, LOCKS["uncommitted update"]):
            wait_for(lambda: not relay.health.alive, 15, "the relay not alive")
            assert relay.health.not_alive_because().startswith("wedged: a mark")
            assert locked not in sent(engine, [locked])
        wait_for(lambda: relay.health.alive, 15, "the relay alive again")
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
    relay = stub_relay(stub_config(outbox_url, shutdown_timeout=6.0), StubSender())
    exit_codes: list[int] = []
    thread = threading.Thread(target=lambda: exit_codes.append(relay.run()), daemon=True)
    with row_locked(outbox_url, locked, LOCKS["select for update"]):
        thread.start()
        wait_for(lambda: relay.metrics.marks_blocked._value.get() >= 1, 20, "a mark held")
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
    (head_key,) = keys_in_shards(1, "head")
    (locked,) = publish_keys(engine, [head_key])
    stub = SlowStub()
    # Its batch is slow: the second transaction's, sent meanwhile, are answered first, and
    # its failure is charged to it.
    stub.slow_keys.add(head_key.encode())
    stub.failing_keys.add(head_key.encode())
    with looping(stub_relay(stub_config(outbox_url, mode=mode), stub)) as relay:
        with row_locked(outbox_url, locked, LOCKS[lock]):
            wait_for(lambda: locked in stub.started, 20, "the locked row sent")
            second = publish_spread(engine, "second")
            shard = shards_of(engine, [locked, *second])
            locked_shard = shard[locked]
            free = [i for i in second if shard[i] != locked_shard]
            # The second transaction goes on every shard but the locked row's.
            wait_for(lambda: sent(engine, free) == set(free), 15, "the other shards' rows sent")
            wait_for(lambda: relay.metrics.marks_blocked._value.get() >= 1, 10, "a record held")
            assert stub.failed == {locked}
            assert stub.tries[locked] == 1  # not read again while its failure waits
            assert attempts_of(engine, locked) == 0  # nor recorded
        everything = [locked, *second]
        wait_for(lambda: sent(engine, everything) == set(everything), 15, "all sent")
    assert attempts_of(engine, locked) == 2  # the failure was recorded, then the send
    sends = Counter(record.id for record in stub.acked)
    assert set(sends) == set(everything) and max(sends.values()) == 1
