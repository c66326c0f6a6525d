"""Row locks of other transactions against the relay's marks, where the lock timeout of the
marking sessions does not reach: a batch with a failure is recorded on the owner session,
and shards are drained before they change hands. Each holds up every shard of the relay for
as long as the lock is held. Real PostgreSQL, the loop's stub publisher; the exactly-once
take-over, real Kafka and a relay process killed while its mark waits."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.devstack.topics import consume_messages
from outbox.records import OutboxRecord
from outbox.relay.daemon import Relay
from tests.integration.test_relay_loop import StubPublisher, config, wait_for
from tests.integration.test_relay_row_locks import (
    LOCKS,
    SPREAD,
    publish_spread,
    row_locked,
    sent,
    shards_of,
)
from tests.relay_helpers import looping, message_id, relay_config, start_relay_process
from tests.relay_outside import wait_until

pytestmark = pytest.mark.integration


def owned(relay: Relay) -> set[int]:
    return set(relay._ownership.owned) if relay._ownership is not None else set()


@contextmanager
def released_first(lock: AbstractContextManager[int], relay: Relay) -> Iterator[Relay]:
    """``relay`` looping while ``lock`` (entered already) is held; the lock goes before the
    relay is stopped, so that a relay the lock holds up can stop."""
    try:
        with looping(relay):
            try:
                yield relay
            finally:
                lock.__exit__(None, None, None)
    finally:
        lock.__exit__(None, None, None)  # (a second rollback is harmless)


def failing_once_beside(
    first: list[uuid.UUID], locked_shard: int
) -> tuple[StubPublisher, set[uuid.UUID]]:
    """A stub that fails, once, the first message of ``first`` outside ``locked_shard``: the
    failure is in the batch that acknowledges the locked row."""
    failed: set[uuid.UUID] = set()

    def decide(record: OutboxRecord) -> str:
        if not failed and record.id in first and record.shard != locked_shard:
            failed.add(record.id)
            return "retry"
        return "ack"

    stub = StubPublisher()
    stub.decide = decide
    return stub, failed


def test_a_batch_with_a_failure_and_a_locked_row_holds_up_no_other_shard(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    first = publish_spread(engine, "first")
    locked = first[0]
    locked_shard = shards_of(engine, [locked])[locked]
    stub, failed = failing_once_beside(first, locked_shard)
    lock = row_locked(outbox_url, locked, LOCKS["select for update"])
    lock.__enter__()
    with released_first(lock, Relay(config(outbox_url), publisher=stub)):
        wait_for(lambda: any(r.id == locked for r in stub.acked))
        assert failed  # the failure is in the locked row's batch
        second = publish_spread(engine, "second")
        shard = shards_of(engine, second)
        free = [i for i in second if shard[i] != locked_shard]
        # Every shard but the locked row's goes on while the lock is held.
        wait_for(lambda: sent(engine, free) == set(free), timeout=10)


def test_a_relay_stopped_while_a_row_lock_holds_a_batch_with_a_failure_exits_in_time(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    first = publish_spread(engine, "first")
    locked = first[0]
    stub, failed = failing_once_beside(first, locked_shard=shards_of(engine, [locked])[locked])
    relay = Relay(config(outbox_url, shutdown_timeout=4.0), publisher=stub)
    thread = threading.Thread(target=relay.run, daemon=True)
    with row_locked(outbox_url, locked, LOCKS["select for update"]):
        thread.start()
        wait_for(lambda: any(r.id == locked for r in stub.acked))
        assert failed
        time.sleep(0.5)  # the outcome is being recorded
        relay.stop()
        thread.join(12)
        stopped_in_time = not thread.is_alive()
    thread.join(30)
    assert stopped_in_time


def test_a_relay_joining_while_a_mark_waits_for_a_row_lock_stops_no_shard(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    first = publish_spread(engine, "first")
    locked = first[0]
    locked_shard = shards_of(engine, [locked])[locked]
    stub, other_stub = StubPublisher(), StubPublisher()
    lock = row_locked(outbox_url, locked, LOCKS["select for update"])
    lock.__enter__()
    with released_first(lock, Relay(config(outbox_url), publisher=stub)) as relay:
        wait_for(lambda: relay.metrics.marks_blocked._value.get() >= 1)
        free_first = [i for i in first if i != locked]
        wait_for(lambda: sent(engine, free_first) == set(free_first))
        with looping(Relay(config(outbox_url), publisher=other_stub)) as other:
            second = publish_spread(engine, "second")
            shard = shards_of(engine, second)
            free = [i for i in second if shard[i] != locked_shard]
            # A rebalance hands half of the shards over; the other shards go on meanwhile
            # (and the joining relay takes its share).
            wait_for(lambda: sent(engine, free) == set(free), timeout=10)
            assert owned(other)


def publish_spread_to(engine: sa.Engine, topic: str, wave: str) -> list[uuid.UUID]:
    """As ``publish_spread``, to a topic of the test's own."""
    with Outbox(engine).transaction() as tx:
        results = tx.publish_many(
            [Message(topic, {"n": n}, key=f"{wave}-{n}") for n in range(SPREAD)]
        )
    return [r.message_id for r in results]


@pytest.mark.xfail(
    strict=True,
    reason="exactly-once, a take-over marks the committed rows on a session without"
    " lock_timeout, and every shard gained with the locked row's waits for it: a relay that"
    " takes over while another transaction holds that row locked sends nothing",
)
def test_a_take_over_whose_committed_row_is_locked_holds_up_no_other_shard(  # type: ignore[no-untyped-def]
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:
    """The first relay's Kafka transaction with the locked row committed, and its mark waits
    for the lock; it dies (SIGKILL). The next owner finds the row in the shard's progress
    record: the other shards go on meanwhile, and the row is marked, never sent again."""
    topic = make_topic("take-over-locked")
    prefix = f"take-over-locked-{uuid.uuid4().hex[:8]}"
    options = ("--mode", "exactly-once", "--transactional-id-prefix", prefix)
    progress = f"{prefix}-progress"
    first = publish_spread_to(engine, topic, "first")
    locked = first[0]
    locked_shard = shards_of(engine, [locked])[locked]
    lock = row_locked(outbox_url, locked, LOCKS["uncommitted update"])
    lock.__enter__()
    try:
        dying = start_relay_process(
            outbox_url, bootstrap_servers, *options, "--progress-topic", progress
        )
        free_first = [i for i in first if i != locked]
        wait_until(lambda: sent(engine, free_first) == set(free_first), 60, "the first rows sent")
        time.sleep(1.0)  # its mark of the locked row is tried again and again meanwhile
        assert not sent(engine, [locked])
        dying.kill()
        dying.wait(30)
        config = relay_config(
            outbox_url,
            bootstrap_servers,
            mode="exactly-once",
            transactional_id_prefix=prefix,
            progress_topic=progress,
        )
        with released_first(lock, Relay(config)):
            second = publish_spread_to(engine, topic, "second")
            shard = shards_of(engine, second)
            free = [i for i in second if shard[i] != locked_shard]
            # The shards whose progress holds no locked row are sent while the lock is held.
            wait_until(lambda: sent(engine, free) == set(free), 30, "the other shards' rows sent")
            lock.__exit__(None, None, None)
            every = set(first + second)
            wait_until(lambda: sent(engine, list(every)) == every, 30, "every row sent")
    finally:
        lock.__exit__(None, None, None)
    on_topic = Counter(
        message_id(record)
        for record in consume_messages(bootstrap_servers, topic, expect=2 * SPREAD)
    )
    assert on_topic[locked] == 1  # marked from the progress record, not sent again
