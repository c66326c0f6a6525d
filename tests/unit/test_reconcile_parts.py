"""The reconciliation's pure parts: the audit window, thresholds and the report."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, date, datetime, timedelta
from itertools import pairwise
from pathlib import Path

import pytest

from outbox.errors import InvalidTopic
from outbox.ids import uuid7_time_ms
from outbox.schema import OutboxTableSpec
from outbox.spark_jobs.classes import CLASSES
from outbox.spark_jobs.discrepancies import skew_beyond
from outbox.spark_jobs.report import RunSummary, parse_thresholds, render
from outbox.spark_jobs.runs import (
    RunNotFound,
    earlier_topics,
    find_run,
    list_runs,
    new_run_id,
    render_run,
    render_runs,
    run_dir,
)
from outbox.spark_jobs.sources import outbox_predicates, outbox_query, topic_pattern
from outbox.spark_jobs.window import AuditWindow, parse_window, uuid7_floor

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


NOW = datetime(2026, 11, 23, 10, 30, tzinfo=UTC)


def window_of(**options: str) -> AuditWindow:
    return parse_window(grace=timedelta(minutes=15), now=NOW, **options)


def test_windows_by_name_duration_and_now() -> None:
    assert window_of() == AuditWindow.day(date(2026, 11, 22))  # yesterday by default
    assert window_of(day="today") == AuditWindow.day(date(2026, 11, 23))
    assert window_of(day="Yesterday") == AuditWindow.day(date(2026, 11, 22))
    assert window_of(day="2026-11-01") == AuditWindow.day(date(2026, 11, 1))
    since = window_of(since="1h")
    assert (since.start, since.end) == (NOW - timedelta(hours=1), NOW)
    assert window_of(since="30m").start == NOW - timedelta(minutes=30)
    assert window_of(since="2d").start == NOW - timedelta(days=2)
    until = window_of(since="1h", end="2026-11-23T08:00:00Z")
    assert (until.start, until.end) == (datetime(2026, 11, 23, 7, tzinfo=UTC), until.end)
    to_now = window_of(start="2026-11-23T09:00", end="now")  # naive: UTC
    assert (to_now.start, to_now.end) == (datetime(2026, 11, 23, 9, tzinfo=UTC), NOW)
    zoned = window_of(start="2026-11-23T12:00:00+02:00", end="now")
    assert zoned.start == datetime(2026, 11, 23, 10, tzinfo=UTC)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"day": "tomorow"}, "--date: 'tomorow' is not a day: give YYYY-MM-DD, today or"),
        ({"day": "2026-11-31"}, "--date: '2026-11-31' is not a day"),
        ({"since": "1 hour"}, "--since: '1 hour' is not a duration like 30m, 1h, 2d or 1w"),
        ({"since": "0m"}, "--since: the window must be longer than 0"),
        ({"start": "yesterday 10am", "end": "now"}, "--start: 'yesterday 10am' is not a date"),
        ({"start": "2026-11-23T09:00"}, "--start and --end go together"),
        ({"end": "now"}, "--start and --end go together"),
        ({"day": "today", "since": "1h"}, "give either --date, or --start/--end, or --since"),
        ({"since": "1h", "start": "now"}, "give either --since or --start"),
        ({"start": "now", "end": "2026-11-23T09:00"}, "before it starts"),
    ],
)
def test_bad_windows_say_why_in_one_line(options: dict[str, str], reason: str) -> None:
    with pytest.raises(ValueError) as raised:
        window_of(**options)
    assert reason in str(raised.value) and "\n" not in str(raised.value)


def test_the_cli_turns_a_bad_window_into_one_error_line_and_exit_2() -> None:
    from click.testing import CliRunner

    from outbox.cli import main

    for args in (["--date", "tomorow"], ["--start", "2026-11-21 8h", "--end", "now"]):
        result = CliRunner().invoke(
            main, ["reconcile", "--database-url", "postgresql://x/y", *args]
        )
        assert result.exit_code == 2, result.output
        assert result.output.startswith("Error: --") and len(result.output.splitlines()) == 1
        assert "isoformat" not in result.output


def test_window_labels_name_a_day_or_a_span() -> None:
    assert AuditWindow.day(date(2026, 11, 21)).label() == "2026-11-21"
    span = AuditWindow(datetime(2026, 11, 21, 10, tzinfo=UTC), datetime(2026, 11, 21, 11, 0, 5))
    assert span.label() == "20261121T100000Z-20261121T110005Z"


def test_every_run_gets_its_own_directory() -> None:
    window = AuditWindow.day(date(2026, 11, 21))
    first, second = (new_run_id(window, NOW) for _ in range(2))
    assert first != second
    assert first.startswith("2026-11-21/20261123T103000Z-") and len(first.split("-")[-1]) == 6
    assert run_dir("reconciliation", first) == f"reconciliation/{first}"
    assert run_dir("s3a://audit/outbox/", first) == f"s3a://audit/outbox/{first}"


def write_run(
    base: Path, run_id: str, started: str, rows: list[dict[str, str]], **extra: object
) -> Path:
    """A run directory as the job writes it (summary.json and the rows as JSON lines)."""
    path = base / run_id
    (path / "discrepancies-json").mkdir(parents=True)
    counts = dict.fromkeys(CLASSES, 0)
    for row in rows:
        counts[row["class"]] += 1
    summary = {
        "run_id": run_id,
        "started_at": started,
        "table": "public.outbox",
        "window": {"start": "2026-11-21T00:00:00+00:00", "end": "2026-11-22T00:00:00+00:00"},
        "topics": ["orders"],
        "discrepancies": counts,
        "verdict": "fail" if rows else "pass",
        **extra,
    }
    (path / "summary.json").write_text(json.dumps(summary))
    half = len(rows) // 2
    for n, part in enumerate((rows[:half], rows[half:])):
        lines = "".join(json.dumps(row) + "\n" for row in part)
        (path / "discrepancies-json" / f"part-0000{n}-x.json").write_text(lines)
    return path


def test_runs_are_listed_newest_first_and_shown_by_class(tmp_path: Path) -> None:
    ghosts = [{"class": "phantom", "message_id": f"ghost-{n}", "topic": "orders"} for n in range(5)]
    lost = {"class": "missing", "message_id": "lost-1", "topic": "orders", "detail": "sent"}
    write_run(tmp_path, "2026-11-21/20261122T031500Z-aaaaaa", "2026-11-22T03:15:00+00:00", [])
    write_run(
        tmp_path, "2026-11-21/20261122T091500Z-bbbbbb", "2026-11-22T09:15:00+00:00",
        [lost, *ghosts], topics=["orders", "refunds"],
    )  # fmt: skip
    listed = list_runs(tmp_path)
    assert [run.run_id for run in listed] == [
        "2026-11-21/20261122T091500Z-bbbbbb",
        "2026-11-21/20261122T031500Z-aaaaaa",
    ]
    table = render_runs(listed)
    assert "FAIL     missing 1, phantom 5" in table and "PASS     0" in table
    assert earlier_topics(tmp_path, "public.outbox") == ["orders", "refunds"]
    assert earlier_topics(tmp_path, "shop.events") == []
    assert earlier_topics(tmp_path / "none-yet", "public.outbox") == []

    latest = find_run("latest", tmp_path)
    assert find_run("2026-11-21/20261122T091500Z-bbbbbb", tmp_path) == latest
    assert find_run(str(latest.path), Path("elsewhere")) == latest
    with pytest.raises(RunNotFound, match="no run 'nope'"):
        find_run("nope", tmp_path)
    rows = latest.rows_by_class(["phantom", "missing"], limit=3)
    assert [r["message_id"] for r in rows["phantom"]] == ["ghost-0", "ghost-1", "ghost-2"]
    text = render_run(latest, rows, 3)
    assert "phantom: 5\n  ghost-0  orders  -  -" in text and "... 2 more" in text
    assert "missing: 1\n  lost-1  orders  -  sent" in text


def test_the_default_packages_are_the_versions_the_stack_resolves_and_pyproject_pins() -> None:
    import re
    import tomllib

    from outbox.spark_jobs.jars import SPARK_PACKAGES

    root = Path(__file__).resolve().parents[2]
    pom = (root / "devstack" / "maven" / "spark" / "pom.xml").read_text()
    prop = {k: v for k, v in re.findall(r"<([a-z.]+\.version)>([^<]+)<", pom)}
    assert (
        f"org.apache.spark:spark-sql-kafka-0-10_{prop['scala.binary.version']}:"
        f"{prop['spark.version']}",
        f"org.postgresql:postgresql:{prop['postgresql.version']}",
    ) == SPARK_PACKAGES
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert extras["optional-dependencies"]["spark"] == [f"pyspark=={prop['spark.version']}"]


def test_spark_options_take_lists_and_repeats_as_spark_submit_does() -> None:
    from click.testing import CliRunner

    from outbox.cli import main
    from outbox.spark_jobs.cli import _split

    assert _split(("a.jar,b.jar", " c.jar ", "")) == ("a.jar", "b.jar", "c.jar")
    args = ["reconcile", "--database-url", "x", "--bootstrap-servers", "k:9092", "--conf", "nokey"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "'nokey' is not KEY=VALUE" in result.output
