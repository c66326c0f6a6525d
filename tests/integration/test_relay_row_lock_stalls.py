"""Row locks of other transactions against the relay's records, where a review found that they
held up every shard of the relay for as long as the lock was held: a batch with a failure
(recorded with the locked row's mark), a relay stopping or joined by another while a mark
waits, and the exactly-once take-over of a committed row another transaction holds locked.
Real PostgreSQL, the stub sender; the take-over, real Kafka and a relay process killed while
its mark waits."""

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
from outbox.relay.daemon import Relay
from outbox.schema import SHARD_COUNT
from tests.integration.test_relay_row_locks import (
    LOCKS,
    SPREAD,
    SlowStub,
    attempts_of,
    publish_keys,
    publish_spread,
    row_locked,
    sent,
    shards_of,
)
from tests.relay_helpers import (
    looping,
    message_id,
    relay_config,
    start_relay_process,
    wait_for,
)
from tests.relay_outside import keys_in_shards, wait_until
from tests.stub_sender import StubSender, stub_config, stub_relay

pytestmark = pytest.mark.integration


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


def failing_beside_a_locked_row(engine: sa.Engine) -> tuple[SlowStub, uuid.UUID, uuid.UUID]:
    """Two rows of shards of their own in one transaction, the one to lock and one whose send
    fails once: one batch, slow, so that a batch sent meanwhile (the second transaction's)
    is answered first and the failure is charged (recorded) with the locked row's mark.
    Returns the stub, the row to lock, and the failing row."""
    head_key, failing_key = keys_in_shards(2, "beside")
    locked, failing = publish_keys(engine, [head_key, failing_key])
    stub = SlowStub()
    stub.slow_keys.add(head_key.encode())
    stub.failing_keys.add(failing_key.encode())
    return stub, locked, failing


def test_a_batch_with_a_failure_and_a_locked_row_holds_up_no_other_shard(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    stub, locked, failing = failing_beside_a_locked_row(engine)
    lock = row_locked(outbox_url, locked, LOCKS["select for update"])
    lock.__enter__()
    with released_first(lock, stub_relay(stub_config(outbox_url), stub)) as relay:
        wait_for(lambda: locked in stub.started, 20, "the locked row's batch sent")
        second = publish_spread(engine, "second")
        locked_shard = shards_of(engine, [locked])[locked]
        wait_for(lambda: stub.failed == {failing}, 10, "the batch to end, the failure with it")
        assert any(r.id == locked for r in stub.acked)  # the failure is in the locked row's batch
        shard = shards_of(engine, [*second, failing])
        free = [i for i in shard if shard[i] != locked_shard]
        # Every shard but the locked row's goes on while the lock is held.
        wait_for(lambda: sent(engine, free) == set(free), 10, "the other shards' rows sent")
        assert attempts_of(engine, failing) == 2  # its failure recorded, then its send
        assert relay.metrics.marks_blocked._value.get() >= 1


def test_a_relay_stopped_while_a_row_lock_holds_a_batch_with_a_failure_exits_in_time(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    stub, locked, failing = failing_beside_a_locked_row(engine)
    relay = stub_relay(stub_config(outbox_url, shutdown_timeout=4.0), stub)
    thread = threading.Thread(target=relay.run, daemon=True)
    with row_locked(outbox_url, locked, LOCKS["select for update"]):
        thread.start()
        wait_for(lambda: locked in stub.started, 20, "the locked row's batch sent")
        publish_spread(engine, "second")
        wait_for(lambda: stub.failed == {failing}, 10, "the batch to end, the failure with it")
        # The outcome is being recorded, and its mark of the locked row waits.
        wait_for(lambda: relay.metrics.marks_blocked._value.get() >= 1, 10, "a record held")
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
    stub, other_stub = StubSender(), StubSender()
    lock = row_locked(outbox_url, locked, LOCKS["select for update"])
    lock.__enter__()
    with released_first(lock, stub_relay(stub_config(outbox_url), stub)) as relay:
        wait_for(lambda: relay.metrics.marks_blocked._value.get() >= 1, 20, "a mark held")
        free_first = [i for i in first if i != locked]
        wait_for(lambda: sent(engine, free_first) == set(free_first), 20, "the first rows sent")
        with looping(stub_relay(stub_config(outbox_url), other_stub)) as other:
            second = publish_spread(engine, "second")
            shard = shards_of(engine, second)
            free = [i for i in second if shard[i] != locked_shard]
            # A rebalance hands half of the shards over; the other shards go on meanwhile,
            # and the joining relay takes its share.
            wait_for(lambda: sent(engine, free) == set(free), 10, "the other shards' rows sent")
            wait_for(
                lambda: (
                    len(other.owned_shards) >= SHARD_COUNT // 2 - 1
                    and len(relay.owned_shards | other.owned_shards) == SHARD_COUNT
                ),
                10,
                "the joining relay to take its share",
            )
            assert locked_shard in relay.owned_shards  # busy with its mark: not handed over
            third = publish_spread(engine, "third")
            shard = shards_of(engine, third)
            free = [i for i in third if shard[i] != locked_shard]
            wait_for(lambda: sent(engine, free) == set(free), 10, "both relays' rows sent")
            assert {r.id for r in other_stub.acked} & set(free)  # some by the joining relay


def publish_spread_to(engine: sa.Engine, topic: str, wave: str) -> list[uuid.UUID]:
    """As ``publish_spread``, to a topic of the test's own."""
    with Outbox(engine).transaction() as tx:
        results = tx.publish_many(
            [Message(topic, {"n": n}, key=f"{wave}-{n}") for n in range(SPREAD)]
        )
    return [r.message_id for r in results]


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
