"""A read beside batches in flight sweeps the other idle shards when the busy set changed since
the last sweep that found nothing, or LOOK_BESIDE_AGAIN after it. Without the time bound (the
defect these reproduce), while the relay is behind (``_behind``) and the busy set stays the same
(one shard's long transaction, a mark held by a row lock, a take-over), each loop step read
only the cursor's group: a row committed to another shard waited for the cursor's turn, up to
``groups`` loop steps of WAIT_SLICE (exactly-once, a group per shard: 2.4-3.0 s measured).

Each case runs in both modes (at-least-once: four groups, ``batch_size`` rows a read in all;
exactly-once: a group per shard, ``batch_size`` rows a shard). Real PostgreSQL, the real loop,
the per-shard stub publisher of test_relay_read_groups_review. The new row is put on the shard
the cursor reaches last, read from ``relay._group`` (the loop steps every WAIT_SLICE meanwhile,
so the race is harmless)."""

from __future__ import annotations

import time
import zlib

import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.relay.daemon import Relay
from outbox.relay.marking import WAIT_SLICE
from outbox.relay.store import shard_window
from outbox.schema import SHARD_COUNT
from tests.integration.test_relay_loop import by_key_in_seq_order, wait_for
from tests.integration.test_relay_read_groups_review import (
    HOT_KEY,
    HOT_SHARD,
    SLOW_KEY,
    SLOW_SHARD,
    CountingStore,
    PerShardStub,
    counting_relay,
    publish_key,
    shard_of_key,
)
from tests.relay_helpers import looping

# Each case bounds a wait by the wall clock (a loop step or two): `make test` runs them alone.
pytestmark = [pytest.mark.integration, pytest.mark.serial]

#: The long transaction of shard 1 (seconds): the busy set stays {1} meanwhile. Each case
#: measures within its first two seconds or so; the relay's stop waits for it to end.
LONG = 6.0

EACH_MODE = pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])


def key_on_shard(shard: int) -> str:
    n = 0
    while zlib.crc32(f"q{n}".encode()) % SHARD_COUNT != shard:
        n += 1
    return f"q{n}"


def row_behind_the_cursor(engine: sa.Engine, relay: Relay, stub: PerShardStub) -> float:
    """Commit one row to the idle shard that the cursor reaches last; seconds until sent."""
    # Preconditions: not AssertionError, so that a broken setup is no expected failure.
    if not relay._behind:
        raise RuntimeError("precondition: the relay is not behind")
    if relay._looked_beside != {SLOW_SHARD}:
        raise RuntimeError(f"precondition: _looked_beside is {set(relay._looked_beside)}")
    assert relay._ownership is not None
    owned = sorted(relay._ownership.owned)
    if len(owned) != SHARD_COUNT:
        raise RuntimeError("precondition: the relay owns every shard")
    cursor = relay._group
    target = next(
        owned[(cursor - k) % len(owned)]
        for k in range(2, len(owned))
        if owned[(cursor - k) % len(owned)] not in (0, SLOW_SHARD, HOT_SHARD)
    )
    key = key_on_shard(target)
    publish_key(engine, key, 1)
    if shard_of_key(engine, key) != target:
        raise RuntimeError("precondition: the key's shard")
    began = time.monotonic()
    wait_for(lambda: any(r.key == key.encode() for r in stub.acked), timeout=LONG - 2)
    waited = time.monotonic() - began
    print(f"cursor {cursor}, row on shard {target}: sent after {waited:.2f}s")
    if stub.ends(SLOW_SHARD):
        raise RuntimeError("precondition: the long transaction ended before the row went")
    return waited


def assert_a_new_row_goes_at_once(
    engine: sa.Engine, outbox_url: str, mode: str, hot_batches: int
) -> None:
    """Shard 1's transaction takes LONG; once shard 15 has sent ``hot_batches`` batches and
    the look beside {1} found nothing, a row on the shard the cursor reaches last goes
    within a loop step or two, in order."""
    stub = PerShardStub(default=0.02, latency={SLOW_SHARD: LONG})
    with counting_relay(outbox_url, stub, None, mode) as relay, looping(relay):
        wait_for(lambda: len(stub.starts(SLOW_SHARD)) >= 1, timeout=30)
        wait_for(lambda: len(stub.ends(HOT_SHARD)) >= hot_batches, timeout=5)
        time.sleep(0.5)  # shard 15 marked; the look beside {1} found nothing
        waited = row_behind_the_cursor(engine, relay, stub)
    assert by_key_in_seq_order(stub.acked)
    assert waited < 5 * WAIT_SLICE, f"a new row on a quiet shard waited {waited:.2f}s"


@EACH_MODE
def test_a_new_row_goes_at_once_beside_a_long_transaction_of_a_backlogged_shard(  # type: ignore[no-untyped-def]
    engine, outbox_url, mode
) -> None:
    """Shard 1 holds two batches; its first transaction takes LONG (the relay is behind:
    that read took a whole batch of one shard). A row committed to a quiet shard should go
    within a loop step or two, as test_a_new_row_goes_at_once_while_one_shards_transaction_is_long
    asks when another shard holds the backlog."""
    publish_key(engine, SLOW_KEY, 100)
    assert_a_new_row_goes_at_once(engine, outbox_url, mode, hot_batches=0)


@EACH_MODE
def test_a_new_row_goes_at_once_after_a_backlog_that_ended_on_a_whole_batch(  # type: ignore[no-untyped-def]
    engine, outbox_url, mode
) -> None:
    """Shard 1's transaction takes LONG; shard 15 held exactly two reads' worth, sent meanwhile.
    Nothing is pending any more, but the relay is still 'behind': a new row on a quiet shard
    should go within a loop step or two."""
    publish_key(engine, SLOW_KEY, 1)
    # Two whole reads of shard 15: exactly-once 50 rows a shard; at-least-once 50 in all, the
    # first of them with shard 1's row.
    publish_key(engine, HOT_KEY, 100 if mode == "exactly-once" else 99)
    assert_a_new_row_goes_at_once(engine, outbox_url, mode, hot_batches=2)


@EACH_MODE
def test_a_burst_on_the_quiet_shards_beside_a_long_transaction(  # type: ignore[no-untyped-def]
    engine, outbox_url, mode
) -> None:
    """Shard 1's transaction takes LONG. One transaction commits a batch's worth of rows to
    each of the other 15 shards: they all go, in order, long before shard 1's transaction
    ends, and the look that finds them (all idle shards in one read) keeps to a read's limits:
    at-least-once ``batch_size`` rows in all, a group-read's window of one shard; exactly-once
    ``batch_size`` rows of one shard."""
    publish_key(engine, SLOW_KEY, 100)
    stub = PerShardStub(default=0.02, latency={SLOW_SHARD: LONG})
    batch_size = 50
    quiet = [shard for shard in range(SHARD_COUNT) if shard != SLOW_SHARD]
    with counting_relay(outbox_url, stub, None, mode) as relay, looping(relay):
        wait_for(lambda: len(stub.starts(SLOW_SHARD)) >= 1, timeout=30)
        time.sleep(0.5)  # the look beside {1} found nothing
        if relay._looked_beside != {SLOW_SHARD}:
            raise RuntimeError(f"precondition: _looked_beside is {set(relay._looked_beside)}")
        store = relay.store
        assert isinstance(store, CountingStore)
        store.largest_read = store.largest_of_one_shard = 0
        with Outbox(engine).transaction() as tx:
            tx.publish_many(
                [
                    Message("t", {"i": i}, key=key_on_shard(shard))
                    for shard in quiet
                    for i in range(batch_size)
                ]
            )
        began = time.monotonic()
        burst = len(quiet) * batch_size
        wait_for(lambda: sum(r.key.startswith(b"q") for r in stub.acked) >= burst, timeout=LONG - 2)
        took = time.monotonic() - began
        if stub.ends(SLOW_SHARD):
            raise RuntimeError("precondition: the long transaction ended before the burst went")
        largest, of_one = store.largest_read, store.largest_of_one_shard
    print(
        f"{mode}: {burst} rows on {len(quiet)} shards sent in {took:.2f}s; largest read {largest}"
    )
    assert by_key_in_seq_order(stub.acked)
    assert took < 5 * WAIT_SLICE, f"the burst took {took:.2f}s beside the long transaction"
    if mode == "at-least-once":
        assert largest <= batch_size
        assert of_one <= shard_window(batch_size, 4)
    else:
        assert of_one <= batch_size
