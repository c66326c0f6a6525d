"""When a message may be delivered: ``deliver_after`` or ``deliver_at``, checked at the API
boundary and turned into one aware UTC datetime (or None: as soon as it can be).

The time is taken on the writer's clock when the message is written; the relay compares it
with the database's clock (``now()``). Clocks kept in step (NTP) agree within milliseconds.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from outbox.errors import InvalidSchedule

#: The longest delay (ten years): more is a mistake, and overflows the database's interval
#: arithmetic.
MAX_DELAY = timedelta(days=3650)


def delivery_time(
    deliver_after: float | timedelta | None,
    deliver_at: datetime | None,
    now: datetime | None = None,
) -> datetime | None:
    """The moment a message may be delivered, or None when it may go now: no time given, a
    delay of 0, or a moment already past at ``now`` (the writer's clock).

    Raises :class:`~outbox.errors.InvalidSchedule` on both given, a naive datetime, a negative,
    non-finite or over-long delay, or a value of another type.
    """
    if deliver_after is None and deliver_at is None:
        return None
    if deliver_after is not None and deliver_at is not None:
        raise InvalidSchedule("give deliver_after or deliver_at, not both")
    now = now or datetime.now(UTC)
    if deliver_at is not None:
        if not isinstance(deliver_at, datetime):
            raise InvalidSchedule(f"deliver_at must be a datetime, got {type(deliver_at).__name__}")
        if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
            raise InvalidSchedule(
                "deliver_at must be an aware datetime (with tzinfo, e.g. UTC): a naive one "
                "would be read in whatever zone the database session has"
            )
        due = deliver_at.astimezone(UTC)
        if due - now > MAX_DELAY:
            raise InvalidSchedule(f"deliver_at is more than {MAX_DELAY.days} days ahead")
    else:
        due = now + _delay(deliver_after)
    return due if due > now else None


def _delay(value: object) -> timedelta:
    if isinstance(value, timedelta):
        delay = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise InvalidSchedule(f"deliver_after must be finite, got {value!r}")
        if abs(value) > MAX_DELAY.total_seconds():
            raise InvalidSchedule(f"deliver_after is more than {MAX_DELAY.days} days")
        delay = timedelta(seconds=value)
    else:
        raise InvalidSchedule(
            f"deliver_after must be seconds (int or float) or a timedelta, got "
            f"{type(value).__name__}"
        )
    if delay < timedelta(0):
        raise InvalidSchedule(f"deliver_after must not be negative, got {value!r}")
    if delay > MAX_DELAY:
        raise InvalidSchedule(f"deliver_after is more than {MAX_DELAY.days} days")
    return delay
