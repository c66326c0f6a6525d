"""``outbox reconcile``: the reconciliation job's command line (also its spark-submit entry).

PySpark is imported only when the command runs, so the rest of the ``outbox`` CLI works
without it.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

import click

from outbox.cli_options import (
    DATABASE_URL,
    SCHEMA,
    TABLE,
    bootstrap_servers_option,
    kafka_settings_option,
    parse_key_values,
)
from outbox.durations import parse_duration
from outbox.errors import OutboxError
from outbox.schema import OutboxTableSpec
from outbox.validation import validate_identifier
from relay.observability import mask_secrets as redact
from spark_jobs.window import AuditWindow  # plain Python: PySpark loads only when the job runs

if TYPE_CHECKING:
    from spark_jobs.reconcile import ReconcileConfig
    from spark_jobs.report import RunSummary

#: Exit status when the job could not run (bad option, unreachable service); 1 means "found
#: discrepancies over their limits", 0 "within limits".
EXIT_ERROR = 2


class JobError(click.ClickException):
    exit_code = EXIT_ERROR


def _duration(value: str, option: str) -> timedelta:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from exc


def _moment(value: str, option: str) -> datetime:
    try:
        moment = datetime.fromisoformat(value)
    except ValueError as exc:
        raise click.BadParameter(
            f"{value!r} is not an ISO date-time like 2026-11-21T00:00:00Z", param_hint=option
        ) from exc
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def build_window(
    day: str | None, start: str | None, end: str | None, grace: timedelta
) -> AuditWindow:
    if day and (start or end):
        raise click.UsageError("give either --date or --start/--end, not both")
    try:
        if day:
            return AuditWindow.day(date.fromisoformat(day), grace)
        if start or end:
            if not (start and end):
                raise click.UsageError("--start and --end go together")
            return AuditWindow(_moment(start, "--start"), _moment(end, "--end"), grace)
        return AuditWindow.yesterday(datetime.now(UTC), grace)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def _runs_table(name: str | None) -> str | None:
    if name is None:
        return None
    parts = name.split(".")
    if len(parts) > 2:
        raise click.BadParameter("expected TABLE or SCHEMA.TABLE", param_hint="--runs-table")
    try:
        return ".".join(validate_identifier(p, "--runs-table") for p in parts)
    except OutboxError as exc:
        raise click.BadParameter(str(exc), param_hint="--runs-table") from exc


def _check_database(database_url: str, spec: OutboxTableSpec) -> None:
    """Fail in one line when the database or the outbox table is out of reach."""
    import sqlalchemy as sa

    try:
        engine = sa.create_engine(database_url)
    except sa.exc.ArgumentError:
        raise click.BadParameter("not a database URL", param_hint="--database-url") from None
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'SELECT 1 FROM "{spec.schema}"."{spec.table}" LIMIT 0'))
    except sa.exc.SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise JobError(f"cannot read {spec.qualified_name}: {redact(reason)}") from None
    finally:
        engine.dispose()


def _check_kafka(bootstrap_servers: str) -> None:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    # log_level 0: the client's own connection-refused lines would bury the one error line.
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, "log_level": 0})
    try:
        admin.list_topics(timeout=15)
    except KafkaException as exc:
        raise JobError(f"cannot reach Kafka at {bootstrap_servers}: {exc.args[0].str()}") from None


@click.command("reconcile")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option("--topic", "topics", multiple=True, help="Audit only these topics (repeatable).")
@click.option("--date", "day", help="Audit this UTC day, YYYY-MM-DD [default: yesterday].")
@click.option("--start", help="Window start, ISO date-time (UTC unless it says otherwise).")
@click.option("--end", help="Window end (exclusive).")
@click.option("--grace", default="15m", show_default=True, help="Slack read at both edges.")
@click.option(
    "--source",
    type=click.Choice(["kafka", "archive"]),
    default="kafka",
    show_default=True,
    help="Where the topic side comes from.",
)
@bootstrap_servers_option(required=False)
@kafka_settings_option(
    "A Kafka client setting for the topic read (Java client names), e.g. "
    "-X security.protocol=SASL_SSL (repeatable)."
)
@click.option("--archive", "archive_path", help="Path (or URI) of the topic archive.")
@click.option(
    "--archive-format", type=click.Choice(["parquet", "json"]), default="parquet", show_default=True
)
@click.option(
    "--output",
    help="Directory for the discrepancy rows and summary.json [default: reconciliation/<run>].",
)
@click.option(
    "--max",
    "limits",
    multiple=True,
    metavar="CLASS=COUNT",
    help="Allow up to COUNT discrepancies of CLASS before failing (repeatable; default 0).",
)
@click.option("--stuck-after", default="1h", show_default=True, help="SLA for pending/dead rows.")
@click.option("--late-after", default="5m", show_default=True, help="SLA from commit to send.")
@click.option("--repair", is_flag=True, help="Put missing messages back to pending.")
@click.option(
    "--repair-despite-skew",
    is_flag=True,
    help="Repair even when the clocks look out of step by more than half the grace.",
)
@click.option("--runs-table", help="Append a row per run to this Postgres table (JDBC).")
@click.option(
    "--master",
    envvar="OUTBOX_SPARK_MASTER",
    help="Spark master [default: local[*], or spark-submit's when run under it].",
)
@click.option("--driver-memory", default="4g", show_default=True, help="Local mode only.")
@click.option("--jdbc-slices", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--fetch-size", default=10_000, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="End with the summary as one JSON line.")
def reconcile(
    database_url: str,
    schema: str,
    table: str,
    topics: tuple[str, ...],
    day: str | None,
    start: str | None,
    end: str | None,
    grace: str,
    source: str,
    bootstrap_servers: str | None,
    kafka_settings: tuple[str, ...],
    archive_path: str | None,
    archive_format: str,
    output: str | None,
    limits: tuple[str, ...],
    stuck_after: str,
    late_after: str,
    repair: bool,
    repair_despite_skew: bool,
    runs_table: str | None,
    master: str | None,
    driver_memory: str,
    jdbc_slices: int,
    fetch_size: int,
    as_json: bool,
) -> None:
    """Audit the outbox against what landed on the topics; exit 1 when over the limits.

    Exit status: 0 every discrepancy class within its limit, 1 some class over it, 2 the job
    could not run, 3 --repair was refused because the clocks look out of step.
    """
    from spark_jobs.reconcile import ReconcileConfig
    from spark_jobs.report import parse_thresholds, render

    window = build_window(day, start, end, _duration(grace, "--grace"))
    try:
        spec = OutboxTableSpec(schema=schema, table=table)
        config = ReconcileConfig(
            database_url=database_url,
            window=window,
            output=output or f"reconciliation/{window.start:%Y-%m-%d}",
            spec=spec,
            topics=topics,
            source=source,
            bootstrap_servers=bootstrap_servers,
            kafka_options=parse_key_values(kafka_settings),
            archive_path=archive_path,
            archive_format=archive_format,
            stuck_after=_duration(stuck_after, "--stuck-after"),
            late_after=_duration(late_after, "--late-after"),
            limits=parse_thresholds(limits),
            repair=repair or repair_despite_skew,
            repair_despite_skew=repair_despite_skew,
            runs_table=_runs_table(runs_table),
            jdbc_slices=jdbc_slices,
            fetch_size=fetch_size,
        )
    except (OutboxError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    _check_database(database_url, spec)
    if source == "kafka" and not config.kafka_options:
        # Settings given with -X are for Spark's (Java) Kafka client; without them a plain
        # connection is checked here, so an unreachable broker fails fast and in one line.
        assert bootstrap_servers is not None
        _check_kafka(bootstrap_servers)

    summary = run_on_spark(config, master, driver_memory)
    click.echo(render(summary))
    if as_json:
        click.echo(json.dumps(summary.to_json()))
    sys.exit(summary.exit_code)


def run_on_spark(config: ReconcileConfig, master: str | None, driver_memory: str) -> RunSummary:
    """Run the job on a session made for it (local mode gets the stack's jars) and stop it.

    Spark's own failures become a one-line :class:`JobError`.
    """
    from spark_jobs.reconcile import run
    from spark_jobs.session import build_session

    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit launched this driver
    if master is None and not under_submit:
        master = "local[*]"
    jars: list[str] = []
    # The job reports its own progress, line by line; Spark's bar redraws one line.
    conf = {"spark.ui.showConsoleProgress": "false"}
    if master and master.startswith("local"):
        from devstack.stack import spark_jars

        jars = [str(jar) for jar in spark_jars()]
        conf["spark.driver.memory"] = driver_memory
    try:
        spark = build_session("outbox-reconcile", master=master, jars=jars, extra_conf=conf)
    except Exception as exc:  # a missing JVM surfaces as several exception types
        raise JobError(f"cannot start Spark: {str(exc).strip().splitlines()[0]}") from None
    spark.sparkContext.setLogLevel("WARN")
    try:
        return run(spark, config)
    except Exception as exc:
        from py4j.protocol import Py4JJavaError
        from pyspark.errors import PySparkException

        if isinstance(exc, PySparkException | Py4JJavaError):
            raise JobError(f"the job failed: {_first_line(exc)}") from None
        raise
    finally:
        spark.stop()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("An error occurred", "JVM stacktrace")):
            return line[:500]
    return text[:500]
