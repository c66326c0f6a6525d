"""Row locks of other transactions against the relay's marks, where the lock timeout of the
marking sessions does not reach: a batch with a failure is recorded on the owner session,
and shards are drained before they change hands. Each holds up every shard of the relay for
as long as the lock is held. Real PostgreSQL, the loop's stub publisher."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import pytest

from outbox.records import OutboxRecord
from outbox.relay.daemon import Relay
from outbox.sending import Ack
from tests.integration.test_relay_loop import StubPublisher, config, wait_for
from tests.integration.test_relay_row_locks import (
    LOCKS,
    publish_spread,
    row_locked,
    sent,
    shards_of,
)
from tests.relay_helpers import looping

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


class CommittedBefore(StubPublisher):
    """Exactly-once: the progress topic says that ``committed`` went in a Kafka transaction
    its shard's last owner committed (a relay that died while its mark waited)."""

    def __init__(self, committed: list[Ack]) -> None:
        super().__init__()
        self.committed = committed
        self.took_over: list[int] = []

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        self.took_over.extend(shards)
        return list(self.committed)


@pytest.mark.xfail(
    strict=True,
    reason="exactly-once, a take-over marks the committed rows on a session without"
    " lock_timeout, and every shard gained with the locked row's waits for it: a relay that"
    " takes over while another transaction holds that row locked sends nothing",
)
def test_a_take_over_whose_committed_row_is_locked_holds_up_no_other_shard(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    first = publish_spread(engine, "first")
    locked = first[0]
    locked_shard = shards_of(engine, [locked])[locked]
    stub = CommittedBefore([Ack(locked, 0, 1, 0)])
    lock = row_locked(outbox_url, locked, LOCKS["uncommitted update"])
    lock.__enter__()
    with released_first(lock, Relay(config(outbox_url, mode="exactly-once"), publisher=stub)):
        wait_for(lambda: locked_shard in stub.took_over)
        shard = shards_of(engine, first)
        free = [i for i in first if shard[i] != locked_shard]
        # The shards whose progress holds no locked row are read while the lock is held.
        wait_for(lambda: sent(engine, free) == set(free), timeout=10)
    assert sent(engine, [locked]) == {locked}  # marked from the progress record, not sent
    assert locked not in {record.id for record in stub.acked}
