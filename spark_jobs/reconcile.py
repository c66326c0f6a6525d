"""The reconciliation job: wires the sources, the discrepancy classes, the outputs and repair.

Run it with ``outbox reconcile ...`` (local Spark) or ``spark-submit spark_jobs/reconcile.py
...`` (any cluster; the same options). Everything that decides what is a discrepancy lives in
:mod:`outbox.spark_jobs.discrepancies`; this module only reads, writes and counts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from outbox.schema import OutboxTableSpec
from outbox.spark_jobs import discrepancies as d
from outbox.spark_jobs.delivery import Delivery
from outbox.spark_jobs.jdbc import jdbc_options
from outbox.spark_jobs.progress import Progress
from outbox.spark_jobs.repair import requeue_missing
from outbox.spark_jobs.report import RunSummary
from outbox.spark_jobs.runs import ROWS, ROWS_JSON, SUMMARY, new_run_id
from outbox.spark_jobs.session import spark_path
from outbox.spark_jobs.sources import normalize_records, read_archive, read_kafka, read_outbox
from outbox.spark_jobs.window import AuditWindow, uuid7_floor


@dataclass(frozen=True)
class ReconcileConfig:
    """Everything one run needs; the CLI builds it from options.

    ``output`` is the run's own directory (the CLI makes it ``<base>/<run_id>``, see
    :mod:`outbox.spark_jobs.runs`).
    """

    database_url: str
    window: AuditWindow
    output: str
    spec: OutboxTableSpec = field(default_factory=OutboxTableSpec)
    #: Audit exactly these topics; when empty, the topics with rows in the window and
    #: ``also_topics``.
    topics: tuple[str, ...] = ()
    #: Topics read even when none of their rows is in the window (the CLI passes those that
    #: earlier runs audited, so a topic whose rows were all purged stays audited).
    also_topics: tuple[str, ...] = ()
    source: str = "kafka"
    bootstrap_servers: str | None = None
    kafka_options: Mapping[str, str] = field(default_factory=dict)
    archive_path: str | None = None
    archive_format: str = "parquet"
    stuck_after: timedelta = timedelta(hours=1)
    late_after: timedelta = timedelta(minutes=5)
    #: The largest count each class may reach; None: no limit (see ``delivery.default_limits``).
    limits: Mapping[str, int | None] = field(default_factory=lambda: dict.fromkeys(d.CLASSES, 0))
    #: The delivery mode ``limits`` were chosen for, reported in the summary.
    delivery: Delivery | None = None
    repair: bool = False
    #: Repair even when the clocks disagree by more than half the grace (see ``skew_beyond``).
    repair_despite_skew: bool = False
    runs_table: str | None = None
    jdbc_slices: int = 8
    fetch_size: int = 10_000
    #: The run's id; a new one (see :func:`outbox.spark_jobs.runs.new_run_id`) when None.
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.source == "kafka" and not self.bootstrap_servers:
            raise ValueError("reading from Kafka needs the bootstrap servers")
        if self.source == "archive" and not self.archive_path:
            raise ValueError("reading from an archive needs its path")
        if self.source not in ("kafka", "archive"):
            raise ValueError(f"unknown topic source {self.source!r}: use kafka or archive")


def topics_in_window(engine: sa.Engine, spec: OutboxTableSpec, window: AuditWindow) -> list[str]:
    """The topics the outbox has messages for in the window (read range), via the id index."""
    low, high = uuid7_floor(window.read_from), uuid7_floor(window.read_until)
    # A recursive "loose index scan" would be faster on huge tables; DISTINCT keeps it plain.
    query = sa.text(
        f'SELECT DISTINCT topic FROM "{spec.schema}"."{spec.table}" '
        "WHERE id >= :low AND id < :high ORDER BY topic"
    )
    with engine.connect() as conn:
        return list(conn.execute(query, {"low": low, "high": high}).scalars())


def latest_sent(engine: sa.Engine, spec: OutboxTableSpec, window: AuditWindow) -> datetime | None:
    """When the last message made in the window was marked sent (None when none was)."""
    low, high = uuid7_floor(window.start), uuid7_floor(window.end)
    query = sa.text(
        f'SELECT max(sent_at) FROM "{spec.schema}"."{spec.table}" WHERE id >= :low AND id < :high'
    )
    with engine.connect() as conn:
        latest: datetime | None = conn.execute(query, {"low": low, "high": high}).scalar()
    return latest


def _topic_side(spark: SparkSession, config: ReconcileConfig, topics: Sequence[str]) -> DataFrame:
    if config.source == "kafka":
        assert config.bootstrap_servers is not None
        raw = read_kafka(
            spark, config.bootstrap_servers, topics, config.window, config.kafka_options
        )
    else:
        assert config.archive_path is not None
        raw = read_archive(
            spark, spark_path(config.archive_path), config.archive_format, topics or None
        )
    return normalize_records(raw, config.window)


def _describe_source(config: ReconcileConfig) -> str:
    if config.source == "kafka":
        return f"kafka {config.bootstrap_servers} (read_committed)"
    return f"archive {config.archive_path} ({config.archive_format})"


def _topic_scope(config: ReconcileConfig) -> str:
    if config.topics:
        return "the topics given"
    if config.source == "archive":
        return "every topic in the archive"
    return "the topics with rows in the window, and those earlier runs audited"


def run(
    spark: SparkSession, config: ReconcileConfig, progress: Progress | None = None
) -> RunSummary:
    """One reconciliation: read, match, classify, write, count, optionally repair."""
    progress = progress or Progress(spark.sparkContext)
    started = time.monotonic()
    as_of = datetime.now(UTC)
    run_id = config.run_id or new_run_id(config.window, as_of)
    engine = sa.create_engine(config.database_url)
    window = config.window
    try:
        # Messages of the window sent after its read ends (late ones, or ones a repair put
        # back) are judged too: the topic side is read up to their sending, never past now.
        window = window.as_read_at(as_of, latest_sent(engine, config.spec, window))
        config = replace(config, window=window)
        rules = d.AuditRules(window, as_of, config.stuck_after, config.late_after)
        topics = list(config.topics)
        without_rows: list[str] = []
        if not topics and config.source == "kafka":
            with progress.step("finding the topics in the window"):
                topics = topics_in_window(engine, config.spec, config.window)
            without_rows = sorted(set(config.also_topics) - set(topics))
            topics = sorted({*topics, *without_rows})
        outbox = read_outbox(
            spark,
            config.database_url,
            config.spec,
            config.window,
            topics=config.topics or None,
            slices=config.jdbc_slices,
            fetch_size=config.fetch_size,
        )
        if topics or config.source == "archive":
            records = _topic_side(spark, config, topics)
        else:  # nothing was published in the window: an empty topic side
            records = spark.createDataFrame([], d.TOPIC_SCHEMA)
        # One pass: the scan counts are observed while the discrepancy rows are written.
        scan = Observation("scan")
        matched = d.match(outbox, records).observe(
            scan,
            F.count("o").alias("rows"),
            F.sum(F.when(F.col("copies").isNull(), 0).otherwise(F.size("copies"))).alias("records"),
            *d.clock_skew(),
        )
        rows_path = spark_path(str(Path(config.output) / ROWS))
        with progress.step(
            f"reading the outbox and the topics, matching by message id, writing {rows_path}"
        ):
            d.find(matched, rules).write.mode("overwrite").parquet(rows_path)
        scanned = scan.get
        found = spark.read.parquet(rows_path)
        # The same rows as JSON lines, for reading without Spark (``outbox reconcile show``).
        found.orderBy("class", "message_id").write.mode("overwrite").json(
            spark_path(str(Path(config.output) / ROWS_JSON))
        )
        counts = {
            (row["class"], row["topic"] or "?"): int(row["count"])
            for row in d.count_by_class_and_topic(found).collect()
        }
        repaired = None
        skew = d.skew_beyond(
            scanned.get("record_ahead_of_sent"), scanned.get("record_behind_id"), window.grace / 2
        )
        repair_refused = None
        to_repair = any(name == d.MISSING for name, _topic in counts)
        if config.repair and skew and to_repair and not config.repair_despite_skew:
            # What looks missing may be records the read missed: requeuing would duplicate.
            repair_refused = f"{skew}, more than half the grace ({window.grace})"
        elif config.repair:
            with progress.step("repair: putting missing messages back to pending"):
                ids = (
                    row.message_id
                    for row in found.where(F.col("class") == d.MISSING)
                    .select("message_id")
                    .toLocalIterator()
                )
                repaired = requeue_missing(engine, config.spec, ids)
    finally:
        engine.dispose()
    summary = RunSummary(
        run_id=run_id,
        window=window,
        source=_describe_source(config),
        outbox_rows=int(scanned.get("rows") or 0),
        topic_records=int(scanned.get("records") or 0),
        counts=counts,
        limits=config.limits,
        seconds=time.monotonic() - started,
        output=rows_path,
        repaired=repaired,
        topics=tuple(topics),
        topics_without_rows=tuple(without_rows),
        topic_scope=_topic_scope(config),
        run_dir=config.output,
        started_at=as_of,
        table=config.spec.qualified_name,
        delivery=config.delivery,
        clock_skew=skew,
        clock_seconds={
            name: None if scanned.get(name) is None else round(float(scanned[name]), 3)
            for name in ("record_ahead_of_sent", "record_behind_id")
        },
        repair_refused=repair_refused,
    )
    write_summary(summary, Path(config.output) / SUMMARY)
    if config.runs_table:
        record_run(spark, config, summary, as_of)
    return summary


def write_summary(summary: RunSummary, path: Path) -> None:
    """The JSON summary beside the discrepancy rows (a local or mounted path)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary.to_json(), indent=2) + "\n")


def record_run(
    spark: SparkSession, config: ReconcileConfig, summary: RunSummary, as_of: datetime
) -> None:
    """Append one row for this run to ``config.runs_table`` over JDBC (created if absent)."""
    body: dict[str, Any] = summary.to_json()
    row = [
        (
            summary.run_id,
            as_of.replace(tzinfo=None),
            summary.window.start.replace(tzinfo=None),
            summary.window.end.replace(tzinfo=None),
            summary.source,
            summary.outbox_rows,
            summary.topic_records,
            sum(summary.per_class().values()),
            json.dumps(body["discrepancies"]),
            body["verdict"],
            summary.repaired,
            float(summary.seconds),
        )
    ]
    frame = spark.createDataFrame(
        row,
        "run_id string, started_at timestamp, window_start timestamp, window_end timestamp, "
        "source string, outbox_rows long, topic_records long, discrepancies long, "
        "by_class string, verdict string, repaired long, seconds double",
    )
    options = jdbc_options(config.database_url)
    url = options.pop("url")
    assert config.runs_table is not None
    frame.write.jdbc(url, config.runs_table, mode="append", properties=options)


if __name__ == "__main__":  # spark-submit .../outbox/spark_jobs/reconcile.py --database-url ...
    import sys

    # Run as a file, this folder comes first on sys.path, where its modules (window, report,
    # session, ...) would shadow top-level ones of the same names: the package is imported
    # by its full name instead.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    from outbox.spark_jobs.cli import reconcile

    reconcile()
