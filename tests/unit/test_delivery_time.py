"""deliver_after / deliver_at checked at the API boundary (no database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from outbox import Message
from outbox.delivery_time import MAX_DELAY, delivery_time
from outbox.errors import InvalidMessage, InvalidSchedule
from outbox.message import encode_message
from outbox.serialization import JsonSerializer

NOW = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)


def test_no_time_a_zero_delay_or_a_past_moment_means_at_once() -> None:
    assert delivery_time(None, None, NOW) is None
    assert delivery_time(0, None, NOW) is None
    assert delivery_time(timedelta(0), None, NOW) is None
    assert delivery_time(None, NOW - timedelta(seconds=1), NOW) is None
    assert delivery_time(None, NOW, NOW) is None


def test_a_delay_or_a_moment_ahead_is_a_utc_due_time() -> None:
    assert delivery_time(1.5, None, NOW) == NOW + timedelta(seconds=1.5)
    assert delivery_time(timedelta(hours=2), None, NOW) == NOW + timedelta(hours=2)
    paris = timezone(timedelta(hours=1))
    due = delivery_time(None, datetime(2026, 11, 28, 14, 0, tzinfo=paris), NOW)
    assert due == NOW + timedelta(hours=1) and due is not None and due.tzinfo is UTC


@pytest.mark.parametrize(
    ("deliver_after", "deliver_at", "says"),
    [
        (5, NOW + timedelta(hours=1), "not both"),
        (None, datetime(2026, 11, 28, 13, 0), "aware datetime"),  # naive
        (-0.5, None, "must not be negative"),
        (timedelta(seconds=-1), None, "must not be negative"),
        (float("nan"), None, "finite"),
        (float("inf"), None, "finite"),
        (True, None, "seconds"),
        ("10", None, "seconds"),
        (MAX_DELAY + timedelta(days=1), None, "days"),
        (None, NOW + MAX_DELAY + timedelta(days=1), "days ahead"),
        (None, "2026-11-28T13:00:00Z", "must be a datetime"),
    ],
)
def test_bad_times_raise_a_typed_error(
    deliver_after: object, deliver_at: object, says: str
) -> None:
    with pytest.raises(InvalidSchedule, match=says) as raised:
        delivery_time(deliver_after, deliver_at, NOW)  # type: ignore[arg-type]
    assert isinstance(raised.value, InvalidMessage)


def test_an_encoded_scheduled_message_is_stored_scheduled_with_its_time() -> None:
    encoded = encode_message(Message("orders", 1, deliver_after=60), JsonSerializer(), 1000)
    assert encoded.row["status"] == "scheduled"
    assert encoded.deliver_at is not None and encoded.row["deliver_at"] == encoded.deliver_at
    plain = encode_message(Message("orders", 1, deliver_after=0), JsonSerializer(), 1000)
    assert "status" not in plain.row and plain.deliver_at is None
