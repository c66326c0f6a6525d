"""The two sides of a reconciliation, read into the frames that
:mod:`outbox.spark_jobs.discrepancies` takes.

The outbox is read over JDBC; the topic side from Kafka (Spark's Kafka source in batch mode)
or from an archive of the topic in Parquet or JSON lines. Both topic sources yield the same
raw shape as Spark's Kafka source (topic, partition, offset, timestamp, key, value, headers) and
go through :func:`normalize_records`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from outbox.errors import ConfigError
from outbox.message import ID_HEADER
from outbox.schema import OutboxTableSpec
from outbox.spark_jobs.discrepancies import OUTBOX_COLUMNS, TOPIC_COLUMNS
from outbox.spark_jobs.jdbc import jdbc_options
from outbox.spark_jobs.window import AuditWindow
from outbox.validation import validate_topic

#: The columns an archive must have, as a sink connector writes a topic.
ARCHIVE_COLUMNS = ("topic", "partition", "offset", "timestamp", "key", "value", "headers")

#: JSON lines archives hold bytes as base64 and timestamps as epoch milliseconds.
JSON_ARCHIVE_SCHEMA = StructType(
    [
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", LongType()),
        StructField("key", StringType()),
        StructField("value", StringType()),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType()), StructField("value", StringType())])
            ),
        ),
    ]
)


class SourceError(ConfigError):
    """A source cannot be read as asked (bad layout, unknown format, no topics)."""


def outbox_query(spec: OutboxTableSpec, topics: Sequence[str] | None) -> str:
    """The subquery each JDBC partition runs, with the value hashed in the database.

    Hashing there sends 32 characters per row instead of the payload. MD5 is enough: the hash
    detects changed payloads, it does not defend against a forger.
    """
    where = ""
    if topics:
        names = ", ".join(f"'{validate_topic(t)}'" for t in topics)  # legal names need no quoting
        where = f" WHERE topic IN ({names})"
    return (
        "(SELECT id AS message_id, topic, key, md5(value) AS value_hash, status,"
        # A message still scheduled waits from when it is due (see OUTBOX_COLUMNS).
        " CASE WHEN status = 'scheduled' THEN deliver_at ELSE created_at END AS created_at,"
        " sent_at, kafka_partition, kafka_offset"
        f' FROM "{spec.schema}"."{spec.table}"{where}) AS outbox'
    )


def outbox_predicates(window: AuditWindow, slices: int) -> list[str]:
    """One ``WHERE`` per parallel read: a slice of the window as an id range (primary key)."""
    return [
        f"message_id >= '{low}'::uuid AND message_id < '{high}'::uuid"
        for low, high in window.id_ranges(slices)
    ]


def read_outbox(
    spark: SparkSession,
    database_url: str,
    spec: OutboxTableSpec,
    window: AuditWindow,
    *,
    topics: Sequence[str] | None = None,
    slices: int = 8,
    fetch_size: int = 10_000,
) -> DataFrame:
    """The outbox rows made in the window (with its grace), read in ``slices`` parallel parts."""
    properties = {**jdbc_options(database_url), "fetchsize": str(fetch_size)}
    url = properties.pop("url")
    frame = spark.read.jdbc(
        url,
        outbox_query(spec, topics),
        predicates=outbox_predicates(window, slices),
        properties=properties,
    )
    return frame.select(*OUTBOX_COLUMNS)


def _millis(moment: datetime) -> str:
    return str(int(moment.timestamp() * 1000))


def topic_pattern(topics: Sequence[str]) -> str:
    """A regular expression matching exactly the given (validated) topic names."""
    return "^(" + "|".join(re.escape(validate_topic(t)) for t in topics) + ")$"


def read_kafka(
    spark: SparkSession,
    bootstrap_servers: str,
    topics: Sequence[str],
    window: AuditWindow,
    options: Mapping[str, str] | None = None,
) -> DataFrame:
    """Committed records of ``topics`` produced in the window (with its grace), in batch.

    Offsets are looked up by timestamp, so only that stretch of each partition is read.
    ``options`` are Kafka client settings (``security.protocol``, ``sasl.*``, ...).
    """
    if not topics:
        raise SourceError("no topics to read: the outbox has no rows in the window")
    reader = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap_servers)
        # A pattern matches only topics that exist: a topic the broker lacks reads as empty
        # (its sent messages are then missing) instead of failing the whole read.
        .option("subscribePattern", topic_pattern(topics))
        .option("kafka.isolation.level", "read_committed")
        .option("includeHeaders", "true")
        .option("startingTimestamp", _millis(window.read_from))
        .option("endingTimestamp", _millis(window.records_read_until))
        # A partition with nothing after the start is read from its end: nothing, not an error.
        .option("startingOffsetsByTimestampStrategy", "latest")
    )
    for key, value in (options or {}).items():
        reader = reader.option(f"kafka.{key}", value)
    return reader.load().select(*ARCHIVE_COLUMNS)


def read_archive(
    spark: SparkSession, path: str, fmt: str, topics: Sequence[str] | None = None
) -> DataFrame:
    """A topic archive in ``parquet`` (Kafka's types) or ``json`` lines (bytes as base64)."""
    if fmt == "parquet":
        frame = spark.read.option("recursiveFileLookup", "true").parquet(path)
        absent = [c for c in ARCHIVE_COLUMNS if c not in frame.columns]
        if absent:
            raise SourceError(f"the archive at {path} lacks the columns {absent}")
        if dict(frame.dtypes)["timestamp"] in ("bigint", "int"):
            frame = frame.withColumn("timestamp", F.timestamp_millis("timestamp"))
    elif fmt == "json":
        raw = spark.read.option("recursiveFileLookup", "true").json(
            path, schema=JSON_ARCHIVE_SCHEMA
        )
        frame = raw.select(
            "topic",
            "partition",
            "offset",
            F.timestamp_millis("timestamp").alias("timestamp"),
            F.unbase64("key").alias("key"),
            F.unbase64("value").alias("value"),
            F.transform(
                "headers",
                lambda h: F.struct(h["key"].alias("key"), F.unbase64(h["value"]).alias("value")),
            ).alias("headers"),
        )
    else:
        raise SourceError(f"unknown archive format {fmt!r}: use parquet or json")
    frame = frame.select(*ARCHIVE_COLUMNS)
    if topics:
        frame = frame.where(F.col("topic").isin(list(topics)))
    return frame


def header_value(headers: Column, name: str) -> Column:
    """The first value of header ``name``, as a string (null when absent)."""
    match = F.filter(headers, lambda h: h["key"] == name)
    return F.try_element_at(match, F.lit(1))["value"].cast("string")


def normalize_records(raw: DataFrame, window: AuditWindow) -> DataFrame:
    """Raw records -> :data:`TOPIC_COLUMNS`: outbox records of the read range, value hashed.

    Records without an ``outbox-id`` header were not published through the outbox; they are
    left out.
    """
    in_range = (F.col("timestamp") >= F.lit(window.read_from)) & (
        F.col("timestamp") < F.lit(window.records_read_until)
    )
    return (
        raw.where(in_range)
        .select(
            header_value(F.col("headers"), ID_HEADER).alias("message_id"),
            "topic",
            "partition",
            "offset",
            "key",
            F.md5("value").alias("value_hash"),
            "timestamp",
        )
        .where(F.col("message_id").isNotNull())
        .select(*TOPIC_COLUMNS)
    )
