"""The discrepancy classes of the reconciliation, as pure DataFrame functions.

Inputs are two normalised frames: the outbox side (:data:`OUTBOX_COLUMNS`, one row per outbox
message) and the topic side (:data:`TOPIC_COLUMNS`, one row per record that carries an outbox
id). :func:`match` joins them once, by message id, into one row per message: its outbox row
(``o``, null when there is none) and every copy found on the topics (``copies``). Each class is
then a condition on that row, so all of them are found in a single pass (:func:`find`), and
each can be asked for alone (:func:`missing`, :func:`duplicates`, ...).

Only messages made inside the audit window count (see :mod:`outbox.spark_jobs.window`); the frames
may hold more, read for the grace period at the edges.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType, TimestampType

from outbox.schema import CANCELLED, DEAD, PENDING, PREPARED, ROLLED_BACK, SCHEDULED, SENT
from outbox.spark_jobs import classes
from outbox.spark_jobs.window import AuditWindow

#: The outbox side, as read over JDBC: one row per outbox message. ``created_at`` is when it
#: could first be sent: committed (a prepared message's commit, a scheduled one's turn to be
#: pending), or, for a message still scheduled, when it is due.
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
#: Its types, as a DDL string (for an empty topic side).
TOPIC_SCHEMA = (
    "message_id string, topic string, partition int, offset long, key binary, "
    "value_hash string, timestamp timestamp"
)

# The class names live in a module without PySpark (for the report and ``show``); they are
# part of this module's API too.
CLASSES = classes.CLASSES
MISSING, DUPLICATE, PHANTOM = classes.MISSING, classes.DUPLICATE, classes.PHANTOM
PAYLOAD_MISMATCH, MISROUTED = classes.PAYLOAD_MISMATCH, classes.MISROUTED
OFFSET_MISMATCH, STUCK, LATE = classes.OFFSET_MISMATCH, classes.STUCK, classes.LATE

DISCREPANCY_SCHEMA = StructType(
    [
        StructField("class", StringType(), True),
        StructField("message_id", StringType(), True),
        StructField("topic", StringType(), True),
        StructField("made_at", TimestampType(), True),
        StructField("detail", StringType(), True),
    ]
)


@dataclass(frozen=True)
class AuditRules:
    """What counts as a discrepancy in one run.

    ``as_of`` is when the run started: rows marked sent after it may have records the topic
    read did not reach, so they are not checked for missing or offset mismatch.
    """

    window: AuditWindow
    as_of: datetime
    stuck_after: timedelta = timedelta(hours=1)
    late_after: timedelta = timedelta(minutes=5)

    def __post_init__(self) -> None:
        if self.as_of.tzinfo is None:
            object.__setattr__(self, "as_of", self.as_of.replace(tzinfo=UTC))

    @property
    def checked_until(self) -> datetime:
        """Rows sent before this must be on the topic read."""
        return min(self.window.records_read_until, self.as_of)


def id_time(message_id: Column) -> Column:
    """The millisecond a UUIDv7 id was made (null for any other id)."""
    digits = F.concat(F.substring(message_id, 1, 8), F.substring(message_id, 10, 4))
    millis = F.conv(digits, 16, 10).cast("long")
    is_v7 = (F.length(message_id) == 36) & (F.substring(message_id, 15, 1) == "7")
    return F.when(is_v7, F.timestamp_millis(millis))


def match(outbox: DataFrame, topic: DataFrame) -> DataFrame:
    """One row per message id: ``o`` (its outbox row or null), ``copies``, ``made_at`` and
    ``topic`` (the row's, else the first copy's)."""
    rows = outbox.select(
        "message_id",
        F.struct(*[c for c in OUTBOX_COLUMNS if c != "message_id"]).alias("o"),
    )
    copies = topic.groupBy("message_id").agg(
        F.array_sort(
            F.collect_list(
                F.struct("topic", "partition", "offset", "key", "value_hash", "timestamp")
            )
        ).alias("copies")
    )
    joined = rows.join(copies, "message_id", "full_outer")
    first_copy = F.try_element_at(F.col("copies"), F.lit(1))
    return joined.select(
        "message_id",
        "o",
        "copies",
        F.coalesce(
            id_time(F.col("message_id")), F.col("o.created_at"), first_copy["timestamp"]
        ).alias("made_at"),
        F.coalesce(F.col("o.topic"), first_copy["topic"]).alias("topic"),
    )


def in_scope(matched: DataFrame, window: AuditWindow) -> DataFrame:
    """The messages made inside the window."""
    return matched.where(
        (F.col("made_at") >= F.lit(window.start)) & (F.col("made_at") < F.lit(window.end))
    )


def _seconds(column: Column) -> Column:
    return F.unix_micros(column) / 1_000_000


def _rules(rules: AuditRules) -> dict[str, tuple[Column, Column]]:
    """For each class: (condition on a matched row, human-readable detail)."""
    o = F.col("o")
    copies = F.col("copies")
    count = F.when(copies.isNull(), 0).otherwise(F.size(copies))
    found_at = F.array_join(
        F.transform(
            copies,
            lambda c: F.concat_ws(
                "/", c["topic"], c["partition"].cast("string"), c["offset"].cast("string")
            ),
        ),
        ", ",
    )
    recorded = F.concat_ws(
        "/", o["topic"], o["kafka_partition"].cast("string"), o["kafka_offset"].cast("string")
    )
    sent = o["status"] == SENT
    # A prepared message is not committed (yet); a rolled-back one never was; a scheduled one
    # is not due (yet), a cancelled one never will be: a record of any of them on a topic is
    # a phantom, as much as one without a row.
    uncommitted = o["status"].isin(PREPARED, ROLLED_BACK, SCHEDULED, CANCELLED)
    checkable = sent & (o["sent_at"] < F.lit(rules.checked_until))
    on_own_topic = F.exists(copies, lambda c: c["topic"] == o["topic"])
    at_recorded = F.exists(
        copies,
        lambda c: (
            (c["topic"] == o["topic"])
            & (c["partition"] == o["kafka_partition"])
            & (c["offset"] == o["kafka_offset"])
        ),
    )
    waited = F.lit(rules.as_of.timestamp()) - _seconds(o["created_at"])
    took = _seconds(o["sent_at"]) - _seconds(o["created_at"])
    return {
        MISSING: (
            checkable & (count == 0),
            F.concat(F.lit("recorded at "), recorded, F.lit(", on no topic")),
        ),
        DUPLICATE: (count > 1, F.concat(count.cast("string"), F.lit(" copies: "), found_at)),
        PHANTOM: (
            (o.isNull() | uncommitted) & (count > 0),
            F.concat(
                F.when(o.isNull(), F.lit("no outbox row"))
                .when(o["status"] == ROLLED_BACK, F.lit("rolled back"))
                .when(o["status"] == SCHEDULED, F.lit("scheduled, not pending yet"))
                .when(o["status"] == CANCELLED, F.lit("cancelled"))
                .otherwise(F.lit("prepared, not committed")),
                F.lit("; at "),
                found_at,
            ),
        ),
        PAYLOAD_MISMATCH: (
            o.isNotNull()
            & F.exists(copies, lambda c: ~c["value_hash"].eqNullSafe(o["value_hash"])),
            F.concat(F.lit("value differs at "), found_at),
        ),
        MISROUTED: (
            o.isNotNull()
            & F.exists(
                copies, lambda c: (c["topic"] != o["topic"]) | ~c["key"].eqNullSafe(o["key"])
            ),
            F.concat(
                F.lit("expected on "), o["topic"], F.lit(" with its key; found at "), found_at
            ),
        ),
        OFFSET_MISMATCH: (
            checkable & o["kafka_partition"].isNotNull() & on_own_topic & ~at_recorded,
            F.concat(F.lit("recorded at "), recorded, F.lit(", found at "), found_at),
        ),
        # A scheduled message waits from when it is due: one not due yet is never stuck.
        STUCK: (
            o["status"].isin(PENDING, DEAD, PREPARED, SCHEDULED)
            & (waited > rules.stuck_after.total_seconds()),
            F.concat(
                F.when(o["status"] == SCHEDULED, F.lit("scheduled, due")).otherwise(o["status"]),
                F.lit(" for "),
                F.round(waited).cast("long").cast("string"),
                F.lit("s"),
            ),
        ),
        LATE: (
            sent & (took > rules.late_after.total_seconds()),
            F.concat(F.lit("sent "), F.round(took, 3).cast("string"), F.lit("s after commit")),
        ),
    }


def clock_skew() -> list[Column]:
    """Aggregates over matched messages (seconds) that show the clocks disagreeing.

    ``record_ahead_of_sent``: the largest lead of a record's timestamp (the producing host's
    clock) over its row's ``sent_at`` (the database's clock, set after Kafka acknowledged it),
    normally below zero. ``record_behind_id``: the smallest lead of a record's timestamp over
    the time in its id (the writing host's clock, before commit), normally above zero.
    """
    o = F.col("o")
    ahead = F.array_max(
        F.transform("copies", lambda c: _seconds(c["timestamp"]) - _seconds(o["sent_at"]))
    )
    behind = F.array_min(
        F.transform("copies", lambda c: _seconds(c["timestamp"]) - _seconds(F.col("made_at")))
    )
    matched = o.isNotNull() & F.col("copies").isNotNull()
    return [
        F.max(F.when(matched & o["sent_at"].isNotNull(), ahead)).alias("record_ahead_of_sent"),
        F.min(F.when(matched, behind)).alias("record_behind_id"),
    ]


def skew_beyond(
    record_ahead_of_sent: float | None, record_behind_id: float | None, tolerance: timedelta
) -> str | None:
    """Why the clocks disagree by more than ``tolerance``, or None when they do not.

    Records are found by their timestamps near the times of their rows; a clock off by more
    than the read's grace makes sent messages look missing.
    """
    limit = tolerance.total_seconds()
    if record_ahead_of_sent is not None and record_ahead_of_sent > limit:
        return (
            f"records are stamped up to {record_ahead_of_sent:.1f}s after their rows were "
            f"marked sent (the producing host's clock runs ahead of the database's)"
        )
    if record_behind_id is not None and record_behind_id < -limit:
        return (
            f"records are stamped up to {-record_behind_id:.1f}s before their messages were "
            f"made (the producing host's clock runs behind the writers')"
        )
    return None


def find(matched: DataFrame, rules: AuditRules, classes: Iterable[str] = CLASSES) -> DataFrame:
    """The discrepancies of the given classes among in-scope messages, in one pass.

    A message can fall in several classes (a duplicate whose copies also differ in payload);
    it gives one row per class.
    """
    wanted = list(classes)
    unknown = set(wanted) - set(CLASSES)
    if unknown:
        raise ValueError(f"unknown discrepancy classes: {sorted(unknown)}")
    conditions = _rules(rules)
    entries = F.array(
        *[
            F.when(
                F.coalesce(conditions[name][0], F.lit(False)),
                F.struct(F.lit(name).alias("class"), conditions[name][1].alias("detail")),
            )
            for name in wanted
        ]
    )
    flagged = in_scope(matched, rules.window).select(
        "message_id",
        "topic",
        "made_at",
        F.explode(F.filter(entries, lambda e: e.isNotNull())).alias("d"),
    )
    return flagged.select(
        F.col("d.class").alias("class"),
        "message_id",
        "topic",
        "made_at",
        F.col("d.detail").alias("detail"),
    )


def missing(matched: DataFrame, rules: AuditRules) -> DataFrame:
    """Sent according to the outbox, but on no topic."""
    return find(matched, rules, [MISSING])


def duplicates(matched: DataFrame, rules: AuditRules) -> DataFrame:
    """The same message id on the topics more than once."""
    return find(matched, rules, [DUPLICATE])


def phantoms(matched: DataFrame, rules: AuditRules) -> DataFrame:
    """Records carrying an outbox id that has no committed outbox row: no row at all, or a
    prepared message not committed (yet), or one rolled back, or a scheduled message not
    pending yet, or one cancelled."""
    return find(matched, rules, [PHANTOM])


def payload_mismatches(matched: DataFrame, rules: AuditRules) -> DataFrame:
    """A copy whose value hash differs from the outbox row's."""
    return find(matched, rules, [PAYLOAD_MISMATCH])


def misrouted(matched: DataFrame, rules: AuditRules) -> DataFrame:
    """A copy on another topic, or with another key, than its outbox row says."""
    return find(matched, rules, [MISROUTED])


def offset_mismatches(matched: DataFrame, rules: AuditRules) -> DataFrame:
    """The partition/offset recorded for a sent row does not hold it."""
    return find(matched, rules, [OFFSET_MISMATCH])


def stuck(matched: DataFrame, rules: AuditRules) -> DataFrame:
    """Pending, dead or prepared (waiting for a verdict) for longer than
    ``rules.stuck_after``: a prepared message counts from when it was prepared, a committed
    one from its commit; a scheduled one still scheduled from when it is due."""
    return find(matched, rules, [STUCK])


def late(matched: DataFrame, rules: AuditRules) -> DataFrame:
    """Sent, but later after commit than ``rules.late_after`` allows (a prepared message's
    commit is its own, not its prepare: ``created_at`` is set to it)."""
    return find(matched, rules, [LATE])


def count_by_class_and_topic(found: DataFrame) -> DataFrame:
    """``class, topic, count`` rows: the report's table."""
    return found.groupBy("class", "topic").count()
