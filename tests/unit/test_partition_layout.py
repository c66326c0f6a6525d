"""The partitioned layout's pure parts: periods, partition names, and id bounds that hold
exactly the ids made within a period."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from outbox.errors import ConfigError
from outbox.partition_layout import (
    INTERVALS,
    Names,
    Partition,
    check_interval,
    interval_of,
    period_start,
)
from outbox.retention import uuid7_floor
from outbox.schema import OutboxTableSpec

MOMENT = datetime(2026, 11, 27, 22, 41, 7, 123456, tzinfo=UTC)


def uuid7_at(moment: datetime, random_bits: int) -> uuid.UUID:
    millis = int(moment.timestamp() * 1000)
    return uuid.UUID(int=(millis << 80) | (0x7 << 76) | (0b10 << 62) | random_bits)


@pytest.mark.parametrize(
    ("interval", "start"),
    [
        ("daily", datetime(2026, 11, 27, tzinfo=UTC)),
        ("hourly", datetime(2026, 11, 27, 22, tzinfo=UTC)),
        ("minutely", datetime(2026, 11, 27, 22, 41, tzinfo=UTC)),
    ],
)
def test_a_period_starts_at_its_day_hour_or_minute_in_utc(interval: str, start: datetime) -> None:
    assert period_start(MOMENT, interval) == start
    elsewhere = MOMENT.astimezone(datetime.now().astimezone().tzinfo)
    assert period_start(elsewhere, interval) == start


@pytest.mark.parametrize("interval", list(INTERVALS))
def test_the_bounds_of_a_period_hold_the_ids_made_in_it_and_no_other(interval: str) -> None:
    start = period_start(MOMENT, interval)
    end = start + INTERVALS[interval]
    low, high = uuid7_floor(start), uuid7_floor(end)
    first, last = uuid7_at(start, 0), uuid7_at(end - timedelta(milliseconds=1), 2**62 - 1)
    assert low <= first and last < high
    assert uuid7_at(start - timedelta(milliseconds=1), 2**62 - 1) < low
    assert not uuid7_at(end, 0) < high


def test_partition_names_say_their_period_and_give_the_interval_back() -> None:
    names = Names(OutboxTableSpec(table="events"))
    assert names.partition(period_start(MOMENT, "daily"), "daily") == "events_p20261127"
    assert names.partition(period_start(MOMENT, "hourly"), "hourly") == "events_p2026112722"
    for interval, width in INTERVALS.items():
        start = period_start(MOMENT, interval)
        parts = [Partition("events_default", None, None), Partition("p", start, start + width)]
        assert interval_of(parts) == interval


def test_an_unknown_interval_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="daily, hourly"):
        check_interval("weekly")
