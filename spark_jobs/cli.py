"""``outbox reconcile``: the reconciliation job's command line (also its spark-submit entry).

``outbox reconcile [options]`` runs an audit; ``outbox reconcile show RUN`` and ``list`` read
the runs already made (see :mod:`outbox.spark_jobs.runs`). PySpark is imported only when an audit
runs, so the rest of the ``outbox`` CLI, ``show`` and ``list`` work without it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import click

from outbox.cli_options import (
    SCHEMA,
    TABLE,
    bootstrap_servers_option,
    kafka_settings_option,
    parse_key_values,
    psycopg_url_option_value,
)
from outbox.durations import parse_duration
from outbox.errors import OutboxError
from outbox.redaction import mask_secrets as redact
from outbox.schema import OutboxTableSpec

# Plain Python: PySpark loads only when the job runs.
from outbox.spark_jobs import delivery, runs
from outbox.spark_jobs.classes import CLASSES
from outbox.spark_jobs.jars import SPARK_PACKAGES
from outbox.spark_jobs.launch import JobError

# Re-exported: chaos and spark-submit users run the job through the CLI module.
from outbox.spark_jobs.launch import SparkSetup as SparkSetup
from outbox.spark_jobs.launch import run_on_spark as run_on_spark
from outbox.spark_jobs.window import AuditWindow, parse_window
from outbox.validation import validate_identifier


def _duration(value: str, option: str) -> timedelta:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from exc


def build_window(
    day: str | None,
    start: str | None,
    end: str | None,
    grace: timedelta,
    since: str | None = None,
    now: datetime | None = None,
) -> AuditWindow:
    """The window the options name; a bad one is a one-line error (exit 2)."""
    try:
        return parse_window(
            day=day, start=start, end=end, since=since, grace=grace, now=now or datetime.now(UTC)
        )
    except ValueError as exc:
        raise JobError(str(exc)) from None


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


def _check_kafka(bootstrap_servers: str) -> set[str]:
    """Fail in one line when Kafka is out of reach; the names of the topics it has."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    # log_level 0: the client's own connection-refused lines would bury the one error line.
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, "log_level": 0})
    try:
        return set(admin.list_topics(timeout=15).topics)
    except KafkaException as exc:
        raise JobError(f"cannot reach Kafka at {bootstrap_servers}: {exc.args[0].str()}") from None


#: The base directory of the runs, for the audit and for ``show`` and ``list``.
OUTPUT = click.option(
    "--output",
    envvar="OUTBOX_RECONCILE_OUTPUT",
    show_envvar=True,
    default=runs.DEFAULT_BASE,
    show_default=True,
    help="Base directory: each run writes to BASE/<window>/<UTC start>-<random>.",
)


@click.group("reconcile", invoke_without_command=True)
@click.option(
    "--database-url",
    envvar="OUTBOX_DATABASE_URL",
    show_envvar=True,
    callback=psycopg_url_option_value,
    help="SQLAlchemy URL, e.g. postgresql+psycopg://user:pw@host/db (needed to audit); "
    "postgres:// and postgresql:// mean the same (psycopg 3).",
)
@SCHEMA
@TABLE
@click.option(
    "--topic",
    "topics",
    multiple=True,
    help="Audit only these topics (repeatable) [default: those with rows in the window, and "
    "those earlier runs under --output audited].",
)
@click.option(
    "--date", "day", help="Audit this UTC day: YYYY-MM-DD, today or yesterday [default: yesterday]."
)
@click.option("--since", help="Audit the last 30m, 1h, 2d, ... up to --end (default: now).")
@click.option("--start", help="Window start: ISO date-time (UTC unless it says otherwise), or now.")
@click.option("--end", help="Window end (exclusive): ISO date-time, or now.")
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
@OUTPUT
@click.option(
    "--max",
    "limits",
    multiple=True,
    metavar="CLASS=COUNT",
    help="Allow up to COUNT discrepancies of CLASS before failing (repeatable) [default: 0, "
    "and no limit for duplicates after at-least-once relaying, see --delivery].",
)
@click.option(
    "--delivery",
    "delivery_choice",
    type=click.Choice(delivery.CHOICES),
    default="auto",
    show_default=True,
    help="How the relays sent the table's messages. at-least-once: duplicates are counted but "
    "not limited by default; exactly-once: their limit is 0. auto: exactly-once when the "
    "exactly-once relay's progress topic exists, else at-least-once (unknown, and limit 0, "
    "when the topics cannot be listed).",
)
@click.option(
    "--progress-topic",
    envvar="OUTBOX_RELAY_PROGRESS_TOPIC",
    show_envvar=True,
    help="The exactly-once relay's progress topic, when its relays were given one "
    "[default: outbox-progress.SCHEMA.TABLE].",
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
    show_envvar=True,
    help="Spark master [default: local[*], or spark-submit's when run under it].",
)
@click.option(
    "--driver-memory",
    help="Local mode only [default: sized from the window: 1g per 12 hours, 1g to 4g; 2g for "
    "a day].",
)
@click.option(
    "--jars",
    "jars",
    multiple=True,
    envvar="OUTBOX_SPARK_JARS",
    show_envvar=True,
    metavar="PATHS",
    help="Jars for the driver and the executors, comma-separated (repeatable) [default: the "
    "local stack's when run from a source checkout, else those `outbox reconcile jars` "
    "fetched, else --packages' default].",
)
@click.option(
    "--packages",
    "packages",
    multiple=True,
    envvar="OUTBOX_SPARK_PACKAGES",
    show_envvar=True,
    metavar="COORDINATES",
    help="Maven coordinates Spark resolves itself, comma-separated (repeatable) [default, "
    "without --jars, outside a source checkout and before `outbox reconcile jars`: "
    f"{','.join(SPARK_PACKAGES)}].",
)
@click.option(
    "--conf",
    "spark_conf",
    multiple=True,
    metavar="KEY=VALUE",
    help="A Spark setting, e.g. --conf spark.executor.memory=2g (repeatable); overrides the "
    "job's own.",
)
@click.option("--jdbc-slices", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--fetch-size", default=10_000, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="End with the summary as one JSON line.")
@click.pass_context
def reconcile(
    ctx: click.Context,
    database_url: str | None,
    schema: str,
    table: str,
    topics: tuple[str, ...],
    day: str | None,
    since: str | None,
    start: str | None,
    end: str | None,
    grace: str,
    source: str,
    bootstrap_servers: str | None,
    kafka_settings: tuple[str, ...],
    archive_path: str | None,
    archive_format: str,
    output: str,
    limits: tuple[str, ...],
    delivery_choice: str,
    progress_topic: str | None,
    stuck_after: str,
    late_after: str,
    repair: bool,
    repair_despite_skew: bool,
    runs_table: str | None,
    master: str | None,
    driver_memory: str | None,
    jars: tuple[str, ...],
    packages: tuple[str, ...],
    spark_conf: tuple[str, ...],
    jdbc_slices: int,
    fetch_size: int,
    as_json: bool,
) -> None:
    """Audit the outbox against what landed on the topics; exit 1 when over the limits.

    Each run writes its summary.json and discrepancy rows to a directory of its own under
    --output and prints it; `outbox reconcile show RUN` lists the discrepant messages and
    `outbox reconcile list` the runs.

    Exit status: 0 every discrepancy class within its limit, 1 some class over it, 2 the job
    could not run, 3 --repair was refused because the clocks look out of step.
    """
    if ctx.invoked_subcommand is not None:
        return
    from outbox.spark_jobs.reconcile import ReconcileConfig
    from outbox.spark_jobs.report import parse_thresholds, render

    if not database_url:
        raise click.UsageError("Missing option '--database-url' (or OUTBOX_DATABASE_URL).")
    started = datetime.now(UTC)
    window = build_window(day, start, end, _duration(grace, "--grace"), since, started)
    run_id = runs.new_run_id(window, started)
    try:
        spec = OutboxTableSpec(schema=schema, table=table)
        config = ReconcileConfig(
            database_url=database_url,
            window=window,
            output=runs.run_dir(output, run_id),
            run_id=run_id,
            spec=spec,
            topics=topics,
            also_topics=_earlier_topics(output, spec) if not topics else (),
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
        spark_setup = SparkSetup(
            master=master,
            driver_memory=driver_memory,
            jars=_split(jars),
            packages=_split(packages),
            conf=parse_key_values(spark_conf, "--conf"),
        )
    except (OutboxError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    _check_database(database_url, spec)
    existing_topics = None
    if source == "kafka" and not config.kafka_options:
        # Settings given with -X are for Spark's (Java) Kafka client; without them a plain
        # connection is checked here, so an unreachable broker fails fast and in one line.
        assert bootstrap_servers is not None
        existing_topics = _check_kafka(bootstrap_servers)
    found = delivery.decide(
        delivery_choice, progress_topic or delivery.progress_topic_of(spec), existing_topics
    )
    config = replace(
        config, delivery=found, limits=parse_thresholds(limits, delivery.default_limits(found))
    )

    click.echo(f"run {run_id}: writing to {config.output}", err=True)
    summary = run_on_spark(config, spark_setup)
    click.echo(render(summary))
    if as_json:
        click.echo(json.dumps(summary.to_json()))
    sys.exit(summary.exit_code)


def _earlier_topics(base: str, spec: OutboxTableSpec) -> tuple[str, ...]:
    """Topics earlier runs under ``base`` audited (a local base only; none for a URI)."""
    if "://" in base:
        return ()
    return tuple(runs.earlier_topics(Path(base), spec.qualified_name))


def _find_run(name: str, base: str) -> runs.Run:
    try:
        return runs.find_run(name, Path(base))
    except runs.RunNotFound as exc:
        raise JobError(str(exc)) from None


@reconcile.command("show")
@click.argument("run", metavar="RUN")
@OUTPUT
@click.option(
    "--class",
    "classes",
    multiple=True,
    type=click.Choice(CLASSES),
    help="Only this class (repeatable) [default: every class with discrepancies].",
)
@click.option(
    "--limit",
    default=20,
    show_default=True,
    type=click.IntRange(min=0),
    help="Messages listed per class; 0 lists all.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
def show(run: str, output: str, classes: tuple[str, ...], limit: int, as_json: bool) -> None:
    """The discrepant messages of a run: counts and ids per class.

    RUN is a run's directory, its id under --output (as `outbox reconcile list` prints it), or
    `latest`. Reads the files the run wrote; needs neither Spark nor the database.
    """
    found = _find_run(run, output)
    counts = found.counts()
    wanted = list(classes) or [name for name in CLASSES if counts[name]]
    try:
        rows = found.rows_by_class(wanted, limit or None)
    except runs.RunNotFound as exc:
        raise JobError(str(exc)) from None
    if as_json:
        body = {
            "run_id": found.run_id,
            "run_dir": str(found.path),
            "window": found.summary.get("window"),
            "topics": found.summary.get("topics"),
            "verdict": found.summary.get("verdict"),
            "counts": counts,
            "discrepancies": rows,
        }
        click.echo(json.dumps(body))
    else:
        click.echo(runs.render_run(found, rows, limit or None))


@reconcile.command("list")
@OUTPUT
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=0),
              help="Runs listed; 0 lists all.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line per run.")
def list_(output: str, limit: int, as_json: bool) -> None:
    """The runs under --output, newest first, with their verdicts and counts."""
    found = runs.list_runs(Path(output))[: limit or None]
    if as_json:
        for run in found:
            click.echo(json.dumps(dict(run.summary)))
    elif found:
        click.echo(runs.render_runs(found))
    else:
        click.echo(f"no runs under {output}")


@reconcile.command("jars")
def jars_() -> None:
    """Fetch Spark's Kafka source and the PostgreSQL JDBC driver with Maven, once.

    They go into this user's cache (OUTBOX_CACHE_DIR, else ~/.cache/outbox-kafka), where
    `outbox reconcile` takes them from when given neither --jars nor --packages. Prints
    their folder and the OUTBOX_SPARK_JARS line that names them, for spark-submit or
    another machine. Needs `mvn`; later runs need no network.
    """
    from outbox.spark_jobs.jars import JarsUnresolved, cached_jars_dir, resolve_jars

    try:
        found = resolve_jars()
    except JarsUnresolved as exc:
        raise JobError(str(exc)) from None
    click.echo(f"{len(found)} jars in {cached_jars_dir()}: `outbox reconcile` uses them")
    click.echo("OUTBOX_SPARK_JARS=" + ",".join(str(jar) for jar in found))


def _split(values: tuple[str, ...]) -> tuple[str, ...]:
    """Repeated options and comma-separated lists, as spark-submit takes them, into one list."""
    return tuple(part.strip() for value in values for part in value.split(",") if part.strip())
