"""The relay's background take-overs and its health once one shard is wedged (no server)."""

from __future__ import annotations

import threading
import time

from outbox.relay.observability import HealthState
from outbox.relay.takeover import TakeOvers


def test_shards_being_taken_over_are_known_until_their_take_over_is_collected() -> None:
    take_overs = TakeOvers()
    release = threading.Event()

    def slow() -> tuple[int, int]:
        release.wait(10)
        return 3, 0

    def failing() -> tuple[int, int]:
        raise TimeoutError("no answer")

    try:
        take_overs.start([1, 2], slow)
        take_overs.start([5], failing)
        assert take_overs.shards == {1, 2, 5}
        take_overs.wait(5)  # the failing one ends first
        [failed] = take_overs.ended()
        assert failed.shards == (5,) and isinstance(failed.error(), TimeoutError)
        assert take_overs.shards == {1, 2} and len(take_overs) == 1
        oldest = take_overs.oldest_start()
        assert oldest is not None and oldest <= time.monotonic()
        release.set()
        [done] = take_overs.ended(wait_for_all=True)
        assert done.error() is None and done.future.result() == (3, 0)
        assert take_overs.shards == set() and take_overs.oldest_start() is None
    finally:
        release.set()
        take_overs.close()


def test_health_turns_bad_when_one_batch_or_take_over_does_not_end() -> None:
    health = HealthState(stale_after=30)
    health.working_since(time.monotonic() - 29)
    health.tick()
    assert health.alive  # the loop turns; nothing has hung for the bound yet
    health.working_since(time.monotonic() - 31)
    assert not health.alive and health.wedged
    assert health.not_alive_because().startswith("wedged")
    health.working_since(None)  # it ended
    assert health.alive


def test_a_mark_or_take_over_has_a_tighter_bound_than_a_batch_on_its_way_to_kafka() -> None:
    health = HealthState(stale_after=360, wedge_after=90)
    health.tick()
    health.working_since(time.monotonic() - 100)  # a batch Kafka may still answer
    assert health.alive
    health.working_since(time.monotonic() - 100, marking=time.monotonic() - 89)
    assert health.alive
    health.working_since(time.monotonic() - 100, marking=time.monotonic() - 91)
    assert not health.alive
    assert health.not_alive_because() == (
        "wedged: a mark or take-over of its shards has not ended for 90s"
    )
    health.working_since(None, marking=None)
    assert health.alive
