"""The relay's health once one batch, mark or take-over does not end, and its settle pause
(no server)."""

from __future__ import annotations

import time

from outbox.relay.observability import HealthState


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


def test_the_settle_pause_doubles_up_to_its_longest_however_many_tries() -> None:
    from outbox.relay.wakeup import MAX_SETTLE_PAUSE, SETTLE_PAUSE, settle_pause

    pauses = [settle_pause(tries) for tries in range(1, 12)]
    assert pauses[0] == SETTLE_PAUSE and pauses == sorted(pauses)
    assert pauses[-1] == MAX_SETTLE_PAUSE
    # An idle relay beside a busy one tries for hours: no overflow (it ended run() once).
    assert settle_pause(10**6) == MAX_SETTLE_PAUSE
