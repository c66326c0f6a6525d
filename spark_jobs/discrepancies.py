"""Discrepancy classes of the reconciliation: pure DataFrame -> DataFrame functions.

Inputs are normalised frames (see :data:`OUTBOX_COLUMNS` and :data:`TOPIC_COLUMNS`); each
function returns rows in :data:`DISCREPANCY_SCHEMA`, one per discrepancy, so that the job can
union them, count them per class and topic, and write them out.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

#: The outbox side, as read over JDBC: one row per outbox message.
OUTBOX_COLUMNS = (
    "message_id",
    "topic",
    "key",
    "value_hash",
    "status",
    "created_at",
    "sent_at",
    "kafka_partition",
    "kafka_offset",
)
#: The topic side, from Kafka or an archive: one row per record carrying an outbox id.
TOPIC_COLUMNS = ("message_id", "topic", "partition", "offset", "key", "value_hash", "timestamp")

DISCREPANCY_SCHEMA = StructType(
    [
        StructField("class", StringType(), False),
        StructField("message_id", StringType(), True),
        StructField("topic", StringType(), True),
        StructField("detail", StringType(), True),
    ]
)

MISSING, DUPLICATE, PHANTOM = "missing", "duplicate", "phantom"
PAYLOAD_MISMATCH, MISROUTED, OFFSET_MISMATCH = "payload_mismatch", "misrouted", "offset_mismatch"
STUCK, LATE = "stuck", "late"
CLASSES = (MISSING, DUPLICATE, PHANTOM, PAYLOAD_MISMATCH, MISROUTED, OFFSET_MISMATCH, STUCK, LATE)


def _shape(frame: DataFrame, kind: str, detail: Column) -> DataFrame:
    return frame.select(
        F.lit(kind).alias("class"),
        F.col("message_id").cast("string").alias("message_id"),
        F.col("topic").cast("string").alias("topic"),
        detail.cast("string").alias("detail"),
    )


def missing(outbox: DataFrame, topic: DataFrame) -> DataFrame:
    """Sent according to the outbox, but on no topic."""
    sent = outbox.where(F.col("status") == "sent")
    absent = sent.join(topic.select("message_id").distinct(), "message_id", "left_anti")
    detail = F.concat(
        F.lit("recorded at "), F.col("kafka_partition"), F.lit("/"), F.col("kafka_offset")
    )
    return _shape(absent, MISSING, detail)


def duplicates(topic: DataFrame) -> DataFrame:
    """The same message id more than once (on any topic)."""
    counted = topic.groupBy("message_id").agg(
        F.count(F.lit(1)).alias("copies"), F.min("topic").alias("topic")
    )
    return _shape(
        counted.where(F.col("copies") > 1), DUPLICATE, F.concat(F.col("copies"), F.lit(" copies"))
    )


def phantoms(outbox: DataFrame, topic: DataFrame) -> DataFrame:
    """Records with an outbox id that no committed outbox row has."""
    orphans = topic.join(outbox.select("message_id"), "message_id", "left_anti")
    detail = F.concat(F.lit("at "), F.col("partition"), F.lit("/"), F.col("offset"))
    return _shape(orphans, PHANTOM, detail)


def _matched(outbox: DataFrame, topic: DataFrame) -> DataFrame:
    o = outbox.alias("o")
    t = topic.alias("t")
    return o.join(t, F.col("o.message_id") == F.col("t.message_id"))


def payload_mismatches(outbox: DataFrame, topic: DataFrame) -> DataFrame:
    """A record whose value hash differs from the outbox row's."""
    pairs = _matched(outbox, topic).where(~F.col("o.value_hash").eqNullSafe(F.col("t.value_hash")))
    return _shape(
        pairs.select(
            F.col("o.message_id").alias("message_id"),
            F.col("t.topic").alias("topic"),
            "t.partition",
            "t.offset",
        ),
        PAYLOAD_MISMATCH,
        F.concat(F.lit("at "), F.col("partition"), F.lit("/"), F.col("offset")),
    )


def misrouted(outbox: DataFrame, topic: DataFrame) -> DataFrame:
    """A record on another topic, or with another key, than its outbox row says."""
    pairs = _matched(outbox, topic).where(
        (F.col("o.topic") != F.col("t.topic")) | ~F.col("o.key").eqNullSafe(F.col("t.key"))
    )
    detail = F.concat(F.lit("expected "), F.col("o.topic"), F.lit(", found on "), F.col("t.topic"))
    return _shape(
        pairs.select(
            F.col("o.message_id").alias("message_id"),
            F.col("o.topic").alias("topic"),
            detail.alias("d"),
        ),
        MISROUTED,
        F.col("d"),
    )


def offset_mismatches(outbox: DataFrame, topic: DataFrame) -> DataFrame:
    """The partition/offset recorded in the outbox does not hold that message."""
    sent = outbox.where(F.col("status") == "sent").alias("o")
    at = topic.alias("t")
    joined = sent.join(
        at,
        (F.col("o.topic") == F.col("t.topic"))
        & (F.col("o.kafka_partition") == F.col("t.partition"))
        & (F.col("o.kafka_offset") == F.col("t.offset")),
        "left",
    ).where(~F.col("o.message_id").eqNullSafe(F.col("t.message_id")))
    detail = F.concat(
        F.lit("recorded "),
        F.col("o.kafka_partition"),
        F.lit("/"),
        F.col("o.kafka_offset"),
        F.lit(" holds "),
        F.coalesce(F.col("t.message_id").cast("string"), F.lit("nothing")),
    )
    return _shape(
        joined.select(
            F.col("o.message_id").alias("message_id"),
            F.col("o.topic").alias("topic"),
            detail.alias("d"),
        ),
        OFFSET_MISMATCH,
        F.col("d"),
    )


def stuck(outbox: DataFrame, now: Column, sla_seconds: float) -> DataFrame:
    """Pending or dead for longer than the SLA."""
    age = now.cast("double") - F.col("created_at").cast("double")
    late_rows = outbox.where(F.col("status").isin("pending", "dead") & (age > sla_seconds))
    return _shape(
        late_rows,
        STUCK,
        F.concat(F.col("status"), F.lit(" for "), F.round(age).cast("long"), F.lit("s")),
    )


def late(outbox: DataFrame, sla_seconds: float) -> DataFrame:
    """Sent, but later after commit than the SLA allows."""
    delay = F.col("sent_at").cast("double") - F.col("created_at").cast("double")
    rows = outbox.where((F.col("status") == "sent") & (delay > sla_seconds))
    return _shape(rows, LATE, F.concat(F.lit("sent after "), F.round(delay, 3), F.lit("s")))
