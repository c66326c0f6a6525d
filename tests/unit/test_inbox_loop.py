"""The inbox runner's loop without servers: Kafka and the database are stand-ins
(tests/inbox_stubs.py), the runner and its applier are the real ones. Batching, retries in
order, parking, a rebalance and a database outage, in milliseconds; the same behaviours on
the real stack are in tests/integration/test_inbox*.py."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson

from outbox.inbox import Inbox, InboxMessage, InboxRunner
from tests.inbox_stubs import MemoryDatabase, StubConsumer, StubRecord, stub_runner

TOPIC = "orders"


def records(partition: int, count: int, ids: list[uuid.UUID] | None = None) -> list[StubRecord]:
    ids = ids or [uuid.uuid4() for _ in range(count)]
    return [
        StubRecord(
            TOPIC,
            partition,
            offset,
            orjson.dumps({"n": offset}),
            [("outbox-id", str(ids[offset]).encode()), ("content-type", b"application/json")],
        )
        for offset in range(count)
    ]


def inbox_failing(fails: dict[tuple[int, int], int] | None = None) -> Inbox:
    """A handler that records (partition, offset) as its effect, and fails ``fails[place]``
    times for a record at that place (forever with a large number)."""
    inbox = Inbox(group="g")
    left = dict(fails or {})

    @inbox.handler(TOPIC)
    def on_order(message: InboxMessage, session: Any) -> None:
        place = (message.partition, message.offset)
        if left.get(place, 0) > 0:
            left[place] -= 1
            raise KeyError("total")
        session.effects.append(place)

    return inbox


@contextmanager
def running(runner: InboxRunner) -> Iterator[InboxRunner]:
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        yield runner
    finally:
        runner.stop()
        thread.join(10)
        assert not thread.is_alive()


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def in_partition(database: MemoryDatabase, partition: int) -> list[int]:
    return [offset for p, offset in database.tables.effects if p == partition]


def test_records_are_applied_once_in_batches_and_their_offsets_committed() -> None:
    log = {(TOPIC, p): records(p, 50) for p in range(3)}
    database = MemoryDatabase()
    runner, consumers = stub_runner(inbox_failing(), log, database, batch_size=20)
    with running(runner):
        wait_for(lambda: len(database.tables.effects) == 150, "all applied")
        wait_for(lambda: consumers[0].committed == {tp: 50 for tp in log}, "offsets committed")
    for p in range(3):
        assert in_partition(database, p) == list(range(50))
    assert database.transactions <= 150 // 20 + 3  # in batches, not one by one
    assert runner.metrics.processed.labels(TOPIC)._value.get() == 150


def test_a_copy_in_the_same_batch_is_a_duplicate_once_the_first_is_applied() -> None:
    message_id = uuid.uuid4()
    log = {(TOPIC, 0): records(0, 2, ids=[message_id, message_id])}
    database = MemoryDatabase()
    runner, consumers = stub_runner(inbox_failing(), log, database)
    with running(runner):
        wait_for(lambda: consumers and consumers[0].committed.get((TOPIC, 0)) == 2, "both")
    assert database.tables.effects == [(0, 0)]
    assert runner.metrics.duplicates.labels(TOPIC)._value.get() == 1


def test_a_failing_record_is_retried_in_order_and_holds_back_only_its_partition() -> None:
    log = {(TOPIC, p): records(p, 10) for p in range(2)}
    database = MemoryDatabase()
    runner, _ = stub_runner(inbox_failing({(0, 3): 2}), log, database, max_attempts=5)
    with running(runner):
        wait_for(lambda: len(database.tables.effects) == 20, "all applied")
    assert in_partition(database, 0) == list(range(10))  # 4..9 after 3, never before
    assert in_partition(database, 1) == list(range(10))
    assert runner.metrics.retried.labels(TOPIC)._value.get() == 2
    assert database.tables.parked == []


def test_a_record_failing_every_attempt_is_parked_with_its_traceback() -> None:
    log = {(TOPIC, 0): records(0, 5)}
    database = MemoryDatabase()
    runner, consumers = stub_runner(inbox_failing({(0, 2): 99}), log, database, max_attempts=3)
    with running(runner):
        wait_for(lambda: consumers and consumers[0].committed.get((TOPIC, 0)) == 5, "past it")
    assert in_partition(database, 0) == [0, 1, 3, 4]
    [parked] = database.tables.parked
    assert (parked["place"], parked["reason"], parked["attempts"]) == ((TOPIC, 0, 2), "handler", 3)
    assert parked["error"].startswith("KeyError: 'total'\nTraceback (most recent call last):")
    assert "on_order" in parked["error"]  # where it came from


def test_a_revoked_partition_has_its_offsets_committed_and_is_read_no_more() -> None:
    log = {(TOPIC, p): records(p, 40) for p in range(2)}
    database = MemoryDatabase()
    runner, consumers = stub_runner(inbox_failing(), log, database, batch_size=10)
    with running(runner):
        wait_for(lambda: len(in_partition(database, 1)) >= 10, "partition 1 under way")
        consumers[0].revoke([(TOPIC, 1)])
        wait_for(lambda: (TOPIC, 1) not in consumers[0].positions, "revoked")
        applied_then = len(in_partition(database, 1))
        wait_for(lambda: len(in_partition(database, 0)) == 40, "partition 0 done")
    # Everything applied of the revoked partition was committed for its next owner, and
    # nothing of it was applied after it went.
    assert consumers[0].committed[(TOPIC, 1)] == applied_then
    assert in_partition(database, 1) == list(range(applied_then))
    assert (TOPIC, 1) not in runner._assigned


def test_a_database_outage_keeps_the_batch_and_skips_nothing() -> None:
    log = {(TOPIC, 0): records(0, 30)}
    database = MemoryDatabase()
    database.down = True
    runner, consumers = stub_runner(inbox_failing(), log, database, batch_size=10)
    with running(runner):
        wait_for(lambda: bool(consumers) and not runner.health.ready, "not ready")
        time.sleep(0.1)
        assert database.tables.effects == [] and consumers[0].committed == {}
        assert "database out of reach" in runner.health.not_ready_because()
        database.down = False
        wait_for(lambda: len(database.tables.effects) == 30, "all applied")
        wait_for(lambda: runner.health.database_ok, "ready again")
    assert in_partition(database, 0) == list(range(30))


def test_stub_consumer_assigns_on_the_first_consume() -> None:
    consumer = StubConsumer({"on_commit": lambda *a: None}, {(TOPIC, 0): records(0, 1)})
    assigned: list[Any] = []
    consumer.subscribe([TOPIC], on_assign=lambda c, ps: assigned.extend(ps))
    assert consumer.consume(10, 0.01) != [] and len(assigned) == 1


def test_a_copy_of_an_undecodable_record_is_applied_and_a_copy_of_a_parked_one_parked() -> None:
    undecodable_id, failing_id = uuid.uuid4(), uuid.uuid4()
    log = {(TOPIC, 0): records(0, 4, ids=[undecodable_id, undecodable_id, failing_id, failing_id])}
    log[(TOPIC, 0)][0]._value = b"{not json"
    database = MemoryDatabase()
    inbox = inbox_failing({(0, 2): 99, (0, 3): 99})
    runner, consumers = stub_runner(inbox, log, database, max_attempts=1, batch_size=10)
    with running(runner):
        wait_for(lambda: consumers and consumers[0].committed.get((TOPIC, 0)) == 4, "all read")
    # The undecodable copy is parked; its readable copy is applied, not taken for its twin.
    assert database.tables.effects == [(0, 1)]
    parked = [(row["place"][2], row["reason"]) for row in database.tables.parked]
    assert parked == [(0, "undecodable"), (2, "handler"), (3, "handler")]
    assert database.tables.parked[2]["error"].startswith("a copy of the message parked from")
    assert runner.metrics.duplicates.labels(TOPIC)._value.get() == 0
