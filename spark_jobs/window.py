"""The time window a reconciliation audits, and how it maps onto outbox ids and topic times.

A message is *in scope* when the time in its id (outbox ids are UUIDv7, so they carry the
millisecond they were made) falls in ``[start, end)``. Both sides are read a grace period wider
than that, so a message near an edge still finds its counterpart: its row was made a little
before the record was produced, and its record may be produced a little after ``end``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, time, timedelta
from itertools import pairwise

from outbox.durations import parse_duration


def uuid7_floor(moment: datetime) -> uuid.UUID:
    """The smallest UUIDv7 made at ``moment`` (ids compare bytewise, so by time first)."""
    millis = int(moment.timestamp() * 1000)
    if not 0 <= millis < 1 << 48:
        raise ValueError(f"{moment.isoformat()} is outside what a UUIDv7 can hold")
    return uuid.UUID(int=(millis << 80) | (0x7 << 76) | (0x2 << 62))


@dataclass(frozen=True)
class AuditWindow:
    """Messages made in ``[start, end)`` (UTC), read with ``grace`` of slack at both edges."""

    start: datetime
    end: datetime
    grace: timedelta = timedelta(minutes=15)
    #: How far the topic side is read, when further than ``read_until`` (see
    #: :meth:`reading_records_until`); the outbox side is always read by id up to ``read_until``.
    records_until: datetime | None = None
    #: The run's start: the topic side is never read past it (see :meth:`as_read_at`).
    read_cap: datetime | None = None

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            moment = getattr(self, name)
            if moment.tzinfo is None:
                object.__setattr__(self, name, moment.replace(tzinfo=UTC))
        if self.end <= self.start:
            raise ValueError(f"the window ends ({self.end}) before it starts ({self.start})")
        if self.grace < timedelta(0):
            raise ValueError("the grace period cannot be negative")

    @classmethod
    def day(cls, day: date, grace: timedelta = timedelta(minutes=15)) -> AuditWindow:
        """The whole UTC day ``day``."""
        start = datetime.combine(day, time(0), tzinfo=UTC)
        return cls(start, start + timedelta(days=1), grace)

    @classmethod
    def yesterday(cls, now: datetime, grace: timedelta = timedelta(minutes=15)) -> AuditWindow:
        """The nightly default: the UTC day before ``now``."""
        return cls.day((now.astimezone(UTC) - timedelta(days=1)).date(), grace)

    @property
    def read_from(self) -> datetime:
        return self.start - self.grace

    @property
    def read_until(self) -> datetime:
        return self.end + self.grace

    @property
    def records_read_until(self) -> datetime:
        """Where the topic side's read ends: records with a timestamp before this are read.

        Never past ``read_cap``, the run's start: a window that ends later (``--date today``)
        is read up to then.
        """
        until = max(self.read_until, self.records_until or self.read_until)
        return min(until, self.read_cap) if self.read_cap else until

    def as_read_at(self, as_of: datetime, latest_sent: datetime | None) -> AuditWindow:
        """This window as a run that starts at ``as_of`` reads it.

        The topic side goes on past the grace up to ``latest_sent`` (when the last message of
        the window was marked sent) plus the grace, so late and requeued messages are judged,
        and it stops at ``as_of`` whatever the window says.
        """
        if as_of.tzinfo is None:
            as_of = as_of.replace(tzinfo=UTC)
        window = replace(self, read_cap=as_of)
        if latest_sent is not None and latest_sent + self.grace > self.read_until:
            window = window.reading_records_until(latest_sent + self.grace)
        return window

    def reading_records_until(self, moment: datetime) -> AuditWindow:
        """This window, with the topic side read up to ``moment`` (when that is later).

        Messages of the window may be sent long after it: late, or put back to pending by a
        repair and sent again. Reading their records too lets the run judge them.
        """
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return replace(self, records_until=moment)

    def id_ranges(self, slices: int) -> list[tuple[uuid.UUID, uuid.UUID]]:
        """``[low, high)`` id bounds splitting the read range into ``slices`` equal spans.

        Each becomes one parallel JDBC read that the primary key index serves.
        """
        if slices < 1:
            raise ValueError("slices must be at least 1")
        span = (self.read_until - self.read_from) / slices
        edges = [self.read_from + span * i for i in range(slices)] + [self.read_until]
        return [(uuid7_floor(lo), uuid7_floor(hi)) for lo, hi in pairwise(edges)]

    @property
    def is_day(self) -> bool:
        """Whether the window is one whole UTC day."""
        return self.start.astimezone(UTC).time() == time(0) and self.end - self.start == timedelta(
            days=1
        )

    def label(self) -> str:
        """A name for the window that sorts by time and is safe in any path: ``2026-11-21`` for a
        UTC day, ``20261121T100000Z-20261121T110000Z`` for any other span."""
        if self.is_day:
            return f"{self.start.astimezone(UTC):%Y-%m-%d}"
        return "-".join(f"{m.astimezone(UTC):%Y%m%dT%H%M%SZ}" for m in (self.start, self.end))

    def describe(self) -> str:
        text = f"{self.start.isoformat()} .. {self.end.isoformat()} (grace {self.grace})"
        if self.records_read_until != self.read_until:
            text += f"; records read until {self.records_read_until.isoformat()}"
        return text


def parse_window(
    *,
    day: str | None = None,
    start: str | None = None,
    end: str | None = None,
    since: str | None = None,
    grace: timedelta = timedelta(minutes=15),
    now: datetime,
) -> AuditWindow:
    """The window the command-line options name; ValueError with a one-line reason otherwise.

    ``day``: ``YYYY-MM-DD``, ``today`` or ``yesterday`` (UTC). ``since``: a duration (``30m``,
    ``1h``, ``2d``) up to ``end``, or up to now. ``start``/``end``: ISO date-times (UTC unless
    they say otherwise) or ``now``. None of them: yesterday.
    """
    if day is not None and (start or end or since):
        raise ValueError("give either --date, or --start/--end, or --since, not several")
    if since is not None and start:
        raise ValueError("give either --since or --start, not both")
    if day is not None:
        return AuditWindow.day(_day(day, now), grace)
    if since is not None:
        try:
            span = parse_duration(since)
        except ValueError:
            raise ValueError(
                f"--since: {since!r} is not a duration like 30m, 1h, 2d or 1w"
            ) from None
        if span <= timedelta(0):
            raise ValueError("--since: the window must be longer than 0")
        until = _moment(end, "--end", now) if end else now
        return AuditWindow(until - span, until, grace)
    if start or end:
        if not (start and end):
            raise ValueError("--start and --end go together (or use --since with --end)")
        return AuditWindow(_moment(start, "--start", now), _moment(end, "--end", now), grace)
    return AuditWindow.yesterday(now, grace)


def _day(text: str, now: datetime) -> date:
    today = now.astimezone(UTC).date()
    named = {"today": today, "yesterday": today - timedelta(days=1)}
    if text.strip().lower() in named:
        return named[text.strip().lower()]
    try:
        return date.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"--date: {text!r} is not a day: give YYYY-MM-DD, today or yesterday (UTC)"
        ) from None


def _moment(text: str, option: str, now: datetime) -> datetime:
    if text.strip().lower() == "now":
        return now
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{option}: {text!r} is not a date-time like 2026-11-21T08:00:00Z, a date, or now"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
