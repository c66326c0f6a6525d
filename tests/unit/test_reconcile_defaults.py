"""The reconciliation's defaults: limits by delivery mode, the read's end, driver memory, and
Ivy's cause when Spark cannot resolve its packages. Pure parts, no Spark."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, date, datetime, timedelta

import pytest

from outbox.relay.config import RelayConfig
from outbox.schema import OutboxTableSpec
from outbox.spark_jobs.classes import CLASSES
from outbox.spark_jobs.delivery import (
    AT_LEAST_ONCE,
    EXACTLY_ONCE,
    UNKNOWN,
    decide,
    default_limits,
    progress_topic_of,
)
from outbox.spark_jobs.gateway import ivy_cause
from outbox.spark_jobs.launch import SparkSetup, driver_memory_for
from outbox.spark_jobs.report import RunSummary, parse_thresholds, render
from outbox.spark_jobs.window import AuditWindow

DAY = AuditWindow.day(date(2026, 11, 21), grace=timedelta(minutes=10))
PROGRESS = "outbox-progress.public.outbox"


def test_the_progress_topic_is_the_one_the_exactly_once_relay_creates() -> None:
    for spec in (OutboxTableSpec(), OutboxTableSpec(schema="shop", table="orders_outbox")):
        relay = RelayConfig(
            database_url="postgresql://x/y", kafka={"bootstrap.servers": "k:9092"}, spec=spec
        )
        assert progress_topic_of(spec) == relay.progress_topic_name


def test_delivery_is_told_by_the_progress_topic() -> None:
    exactly = decide("auto", PROGRESS, {"orders", PROGRESS})
    assert exactly.mode == EXACTLY_ONCE and PROGRESS in exactly.reason
    at_least = decide("auto", PROGRESS, {"orders", "outbox-progress.shop.other"})
    assert at_least.mode == AT_LEAST_ONCE and f"no progress topic {PROGRESS}" in at_least.reason
    unknown = decide("auto", PROGRESS, None)
    assert unknown.mode == UNKNOWN and "--delivery" in unknown.reason
    given = decide(AT_LEAST_ONCE, PROGRESS, {PROGRESS})
    assert given.mode == AT_LEAST_ONCE and given.reason == "given with --delivery"
    with pytest.raises(ValueError, match="--delivery"):
        decide("twice", PROGRESS, set())


def test_duplicates_have_no_default_limit_only_after_at_least_once_relaying() -> None:
    assert default_limits(decide("auto", PROGRESS, set())) == {
        **dict.fromkeys(CLASSES, 0),
        "duplicate": None,
    }
    for strict in (decide("auto", PROGRESS, {PROGRESS}), decide("auto", PROGRESS, None)):
        assert default_limits(strict) == dict.fromkeys(CLASSES, 0)
    # --max still sets a limit, over the default.
    relaxed = default_limits(decide(AT_LEAST_ONCE, PROGRESS, None))
    assert parse_thresholds(["duplicate=1000"], relaxed)["duplicate"] == 1000
    assert parse_thresholds(["late=3"], relaxed) == {**relaxed, "late": 3}


def after_a_relay_kill(mode: str) -> RunSummary:
    """The run the nightly job made after an at-least-once relay was killed: 604 duplicates."""
    delivery = decide("auto", PROGRESS, {PROGRESS} if mode == EXACTLY_ONCE else set())
    return RunSummary(
        run_id="r1",
        window=DAY,
        source="kafka x (read_committed)",
        outbox_rows=100_056,
        topic_records=100_660,
        counts={("duplicate", "orders"): 604},
        limits=default_limits(delivery),
        seconds=40.0,
        output="out/discrepancies",
        delivery=delivery,
    )


def test_duplicates_after_at_least_once_are_counted_shown_and_pass() -> None:
    run = after_a_relay_kill(AT_LEAST_ONCE)
    assert run.passed and run.exit_code == 0
    text = render(run)
    assert "  duplicate                604       -\n" in text
    assert f"  delivery       at-least-once (no progress topic {PROGRESS}" in text
    assert "duplicates are counted, not limited (--max duplicate=N limits them)" in text
    assert text.endswith("verdict: PASS (604 discrepancies, all within limits)")
    body = run.to_json()
    assert body["discrepancies"]["duplicate"] == 604 and body["limits"]["duplicate"] is None
    assert body["delivery"]["mode"] == AT_LEAST_ONCE and body["verdict"] == "pass"


def test_duplicates_after_exactly_once_still_fail() -> None:
    run = after_a_relay_kill(EXACTLY_ONCE)
    assert run.exit_code == 1 and run.breaches() == {"duplicate": (604, 0)}
    text = render(run)
    assert "  duplicate                604       0  FAIL" in text
    assert "not limited" not in text and text.endswith("verdict: FAIL (duplicate 604 > 0)")


def test_records_are_never_read_past_the_run_start() -> None:
    today = AuditWindow.day(date(2026, 11, 27), grace=timedelta(minutes=15))
    start = datetime(2026, 11, 27, 19, 0, tzinfo=UTC)
    read = today.as_read_at(start, latest_sent=start - timedelta(seconds=3))
    assert read.records_read_until == start  # not midnight tonight plus the grace
    assert read.read_until == today.read_until  # the outbox side: by id, as before
    assert f"records read until {start.isoformat()}" in read.describe()
    nothing_sent = today.as_read_at(start, latest_sent=None)
    assert nothing_sent.records_read_until == start

    # Yesterday, a message sent late: read up to its sending plus the grace...
    now = datetime(2026, 11, 22, 3, 0, tzinfo=UTC)
    late = DAY.as_read_at(now, latest_sent=datetime(2026, 11, 22, 1, 0, tzinfo=UTC))
    assert late.records_read_until == datetime(2026, 11, 22, 1, 10, tzinfo=UTC)
    # ... but not past the start, however late it was sent.
    assert DAY.as_read_at(now, latest_sent=now).records_read_until == now
    on_time = DAY.as_read_at(now, latest_sent=datetime(2026, 11, 21, 23, 0, tzinfo=UTC))
    assert on_time.records_read_until == DAY.read_until and on_time.describe() == DAY.describe()
    assert replace(DAY, read_cap=None).records_read_until == DAY.read_until


@pytest.mark.parametrize(
    ("span", "memory"),
    [
        (timedelta(minutes=30), "1g"),
        (timedelta(hours=12), "1g"),
        (timedelta(hours=13), "2g"),
        (timedelta(days=1), "2g"),
        (timedelta(hours=36), "3g"),
        (timedelta(days=7), "4g"),
    ],
)
def test_the_driver_memory_is_sized_from_the_window(span: timedelta, memory: str) -> None:
    start = datetime(2026, 11, 21, tzinfo=UTC)
    assert driver_memory_for(AuditWindow(start, start + span)) == memory


def test_the_default_driver_memory_is_no_longer_a_fixed_4g() -> None:
    assert SparkSetup().driver_memory is None  # sized from the window at run time
    assert driver_memory_for(AuditWindow.yesterday(datetime.now(UTC))) == "2g"


#: What Spark 4.0 prints when ~/.m2 holds a POM without its jar (shortened).
POM_ONLY = """\
:: loading settings :: url = jar:file:/venv/pyspark/jars/ivy-2.5.3.jar!/ivysettings.xml
Ivy Default Cache set to: /home/u/.ivy2.5.2/cache
org.postgresql#postgresql added as a dependency
\tfound org.postgresql#postgresql;42.7.7 in local-m2-cache
:: problems summary ::
:::: WARNINGS
\t\t[NOT FOUND  ] org.postgresql#postgresql;42.7.7!postgresql.jar (16ms)
\t==== local-m2-cache: tried
\t  file:/home/u/.m2/repository/org/postgresql/postgresql/42.7.7/postgresql-42.7.7.jar
\t\t::              FAILED DOWNLOADS            ::
\t\t:: org.postgresql#postgresql;42.7.7!postgresql.jar
:: USE VERBOSE OR DEBUG MESSAGE LEVEL FOR MORE DETAILS
Exception in thread "main" java.lang.RuntimeException: [download failed: \
org.postgresql#postgresql;42.7.7!postgresql.jar]
\tat org.apache.spark.util.MavenUtils$.resolveMavenCoordinates(MavenUtils.scala:540)
"""


def test_ivys_cause_is_one_line() -> None:
    found = ivy_cause(POM_ONLY)
    assert found is not None
    assert found.cause == "download failed: org.postgresql#postgresql;42.7.7!postgresql.jar"
    jar = "file:/home/u/.m2/repository/org/postgresql/postgresql/42.7.7/postgresql-42.7.7.jar"
    assert found.tried == (jar,)
    assert str(found) == f"{found.cause} (tried {jar})" and "\n" not in str(found)
    unresolved = ivy_cause(
        'Exception in thread "main" java.lang.RuntimeException: '
        "[unresolved dependency: org.example#nothing;1.0: not found]\n"
    )
    assert unresolved is not None and str(unresolved) == (
        "unresolved dependency: org.example#nothing;1.0: not found"
    )
    assert ivy_cause("Error: JAVA_HOME is not set\n") is None
