"""Durations, UUIDv7 bounds for retention, and the named query file."""

from datetime import UTC, datetime, timedelta

import pytest

from outbox.durations import parse_duration
from outbox.ids import uuid7
from outbox.queries import Queries, _raw_queries
from outbox.retention import uuid7_floor
from outbox.schema import OutboxTableSpec


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", timedelta(seconds=90)),
        ("15m", timedelta(minutes=15)),
        ("7d", timedelta(days=7)),
        ("1.5h", timedelta(hours=1.5)),
        ("2w", timedelta(weeks=2)),
    ],
)
def test_durations(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "7", "d", "3 days", "-1d", "1y"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_uuid7_floor_orders_against_real_ids() -> None:
    before = uuid7()
    floor = uuid7_floor(datetime.now(UTC) + timedelta(milliseconds=5))
    after_floor = uuid7_floor(datetime.now(UTC) - timedelta(seconds=1))
    assert floor.version == 7
    assert before < floor
    assert after_floor < before


def test_queries_are_named_and_filled_with_the_table() -> None:
    assert {"read_batch", "mark_sent", "release", "purge_sent"} <= set(_raw_queries())
    queries = Queries(OutboxTableSpec("shop", "events"))
    assert '"shop"."events"' in str(queries["release"])
    assert "{table}" not in str(queries["purge_sent"])
    # A query used inside another is spliced in, filled with the same table.
    clear = str(queries["clear_to_send"])
    assert "{leased_behind_earlier}" not in clear and "{table}" not in clear
    assert "WITH mine AS" in clear and '"shop"."events"' in clear


def test_uuid7_is_ordered_unique_and_keeps_to_the_clock() -> None:
    import time

    from outbox.ids import uuid7_time_ms

    start_ms = time.time_ns() // 1_000_000
    ids = [uuid7() for _ in range(20_000)]
    end_ms = time.time_ns() // 1_000_000
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert all(i.version == 7 and i.variant == "specified in RFC 4122" for i in ids[:10])
    # 20,000 ids in a few milliseconds must not push the timestamp past the clock
    assert start_ms <= uuid7_time_ms(ids[0]) <= uuid7_time_ms(ids[-1]) <= end_ms + 1
