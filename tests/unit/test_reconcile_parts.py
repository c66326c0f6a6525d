"""The reconciliation's pure parts: the audit window, thresholds and the report."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta
from itertools import pairwise

import pytest

from outbox.errors import InvalidTopic
from outbox.ids import uuid7_time_ms
from outbox.schema import OutboxTableSpec
from spark_jobs.discrepancies import CLASSES, skew_beyond
from spark_jobs.report import RunSummary, parse_thresholds, render
from spark_jobs.sources import outbox_predicates, outbox_query, topic_pattern
from spark_jobs.window import AuditWindow, uuid7_floor

DAY = AuditWindow.day(date(2026, 11, 21), grace=timedelta(minutes=10))


def test_uuid7_floor_sorts_by_time_and_reads_back() -> None:
    moment = datetime(2026, 11, 21, 8, 0, 0, 250000, tzinfo=UTC)
    floor = uuid7_floor(moment)
    assert floor.version == 7 and floor.variant == uuid.RFC_4122
    assert uuid7_time_ms(floor) == int(moment.timestamp() * 1000)
    assert floor < uuid7_floor(moment + timedelta(milliseconds=1))
    with pytest.raises(ValueError, match="outside"):
        uuid7_floor(datetime(1960, 1, 1, tzinfo=UTC))


def test_yesterday_is_the_previous_utc_day_read_with_grace() -> None:
    window = AuditWindow.yesterday(datetime(2026, 11, 22, 3, 0, tzinfo=UTC))
    assert window.start == datetime(2026, 11, 21, tzinfo=UTC)
    assert window.end == datetime(2026, 11, 22, tzinfo=UTC)
    assert window.read_from == window.start - timedelta(minutes=15)
    assert window.read_until == window.end + timedelta(minutes=15)


def test_id_ranges_tile_the_read_range_without_gaps() -> None:
    ranges = DAY.id_ranges(5)
    assert len(ranges) == 5
    assert ranges[0][0] == uuid7_floor(DAY.read_from)
    assert ranges[-1][1] == uuid7_floor(DAY.read_until)
    assert all(high == low for (_, high), (low, _) in pairwise(ranges))
    with pytest.raises(ValueError):
        DAY.id_ranges(0)


def test_a_window_must_be_well_formed() -> None:
    start = datetime(2026, 11, 21, tzinfo=UTC)
    with pytest.raises(ValueError, match="before it starts"):
        AuditWindow(start, start)
    with pytest.raises(ValueError, match="negative"):
        AuditWindow(start, start + timedelta(hours=1), timedelta(seconds=-1))
    naive = AuditWindow(datetime(2026, 11, 21), datetime(2026, 11, 22))
    assert naive.start.tzinfo is UTC


def test_the_outbox_query_hashes_in_the_database_and_reads_by_id_range() -> None:
    spec = OutboxTableSpec(schema="shop", table="outbox")
    query = outbox_query(spec, ["orders", "pay.v1"])
    assert "FROM \"shop\".\"outbox\" WHERE topic IN ('orders', 'pay.v1')" in query
    assert "md5(value) AS value_hash" in query
    predicates = outbox_predicates(DAY, 3)
    assert len(predicates) == 3
    assert predicates[0].startswith(f"message_id >= '{uuid7_floor(DAY.read_from)}'::uuid")
    with pytest.raises(InvalidTopic):
        outbox_query(spec, ["orders'; DROP TABLE outbox; --"])


def test_topic_pattern_matches_only_the_named_topics() -> None:
    import re

    pattern = re.compile(topic_pattern(["orders", "pay.v1"]))
    assert pattern.match("orders") and pattern.match("pay.v1")
    assert not pattern.match("payXv1") and not pattern.match("orders-dlq")


def test_thresholds_default_to_zero_and_are_checked() -> None:
    limits = parse_thresholds(["duplicate=10", "payload-mismatch=2"])
    assert limits["duplicate"] == 10 and limits["payload_mismatch"] == 2 and limits["missing"] == 0
    assert set(limits) == set(CLASSES)
    for bad in ("lost=1", "missing", "missing=-1", "missing=many"):
        with pytest.raises(ValueError):
            parse_thresholds([bad])


def summary(counts: dict[tuple[str, str], int], limits: dict[str, int]) -> RunSummary:
    return RunSummary(
        run_id="r1",
        window=DAY,
        source="kafka x (read_committed)",
        outbox_rows=1000,
        topic_records=1001,
        counts=counts,
        limits={**dict.fromkeys(CLASSES, 0), **limits},
        seconds=12.5,
        output="out/discrepancies",
        repaired=2,
    )


def test_verdict_exit_code_and_report() -> None:
    over = summary({("missing", "orders"): 2, ("duplicate", "pay"): 3}, {"duplicate": 5})
    assert over.breaches() == {"missing": (2, 0)}
    assert over.exit_code == 1
    text = render(over)
    assert "missing                    2       0  FAIL" in text
    assert "duplicate                  3       5\n" in text
    assert "    orders: missing 2" in text and "    pay: duplicate 3" in text
    assert "2 missing messages put back to pending" in text
    assert text.endswith("verdict: FAIL (missing 2 > 0)")
    body = over.to_json()
    assert body["verdict"] == "fail" and body["discrepancies"]["duplicate"] == 3
    assert body["breaches"] == {"missing": {"count": 2, "limit": 0}}

    within = summary({("duplicate", "pay"): 3}, {"duplicate": 5})
    assert within.exit_code == 0
    assert render(within).endswith("verdict: PASS (3 discrepancies, all within limits)")


def test_the_topic_side_may_be_read_further_than_the_outbox_side() -> None:
    window = AuditWindow.day(date(2026, 11, 21), timedelta(minutes=15))
    assert window.records_read_until == window.read_until
    later = window.reading_records_until(datetime(2026, 11, 23, 3, 0))  # naive: UTC
    assert later.records_read_until == datetime(2026, 11, 23, 3, 0, tzinfo=UTC)
    assert later.id_ranges(4) == window.id_ranges(4)  # the outbox is read by id as before
    assert "records read until 2026-11-23T03:00:00+00:00" in later.describe()
    # Never shorter than the window's own read.
    earlier = window.reading_records_until(datetime(2026, 11, 21, 12, 0, tzinfo=UTC))
    assert earlier.records_read_until == window.read_until


def test_clock_skew_beyond_the_tolerance_is_named() -> None:
    half_grace = timedelta(seconds=30)
    assert skew_beyond(-0.2, 0.5, half_grace) is None  # normal: stamped before sent, after made
    assert skew_beyond(None, None, half_grace) is None  # nothing matched
    ahead = skew_beyond(45.0, 0.5, half_grace)
    assert ahead and "45.0s after" in ahead and "ahead" in ahead
    behind = skew_beyond(-0.2, -180.0, half_grace)
    assert behind and "180.0s before" in behind and "behind" in behind


def test_a_refused_repair_has_its_own_exit_code_and_says_why() -> None:
    window = AuditWindow.day(date(2026, 11, 21))
    summary = RunSummary(
        run_id="r",
        window=window,
        source="kafka",
        outbox_rows=10,
        topic_records=9,
        counts={("missing", "orders"): 1},
        limits=dict.fromkeys(CLASSES, 0),
        seconds=1.0,
        output="out",
        clock_skew="records are stamped up to 180.0s before ...",
        repair_refused="records are stamped up to 180.0s before ..., more than half the grace",
    )
    assert summary.exit_code == 3
    assert summary.to_json()["repair_refused"].startswith("records are stamped")
    assert "repair refused" in render(summary) and "--repair-despite-skew" in render(summary)
