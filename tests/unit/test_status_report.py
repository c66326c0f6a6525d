"""`outbox status`'s text: ages and shard lists a person reads at a glance."""

from __future__ import annotations

from datetime import UTC, datetime

from outbox.status import OutboxStatus, RelayStatus, StatusCount, TopicStatus
from outbox.status_report import age, shard_ranges, to_text


def test_ages_read_in_the_largest_useful_units() -> None:
    assert [age(s) for s in (None, 0.04, 59.9, 61, 3599, 7380, 90000)] == [
        "-",
        "0.0s",
        "59.9s",
        "1m01s",
        "59m59s",
        "2h03m",
        "1d01h",
    ]


def test_shards_read_as_ranges() -> None:
    assert shard_ranges([]) == "none"
    assert shard_ranges([3]) == "3"
    assert shard_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert shard_ranges(list(range(16))) == "0-15"


def test_estimates_are_marked_and_unknowns_are_not_zero() -> None:
    report = OutboxStatus(
        table="public.outbox",
        taken_at=datetime(2026, 11, 27, 12, 0, tzinfo=UTC),
        exact=False,
        statuses={
            "pending": StatusCount(12, False),
            "sent": StatusCount(1_000_000, True),
            "dead": StatusCount(None, True),
        },
        topics=[TopicStatus("orders", pending=12, oldest_pending_seconds=75.0)],
        relays=[RelayStatus("relay-a", 42, None, None, member=True, shards=[0, 1, 2])],
        unowned_shards=list(range(3, 16)),
        prepared_groups=[],
    )
    text = "\n".join(to_text(report))
    assert "messages: pending 12, sent ~1,000,000, dead ?" in text
    assert "oldest pending: 1m15s" in text
    assert "relay-a" in text and "member" in text and "0-2" in text
    assert "unowned shards: 3-15 (of 16)" in text
    assert "SENT" not in text  # per-topic counts of the other statuses only with --exact
