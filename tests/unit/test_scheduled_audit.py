"""The reconciliation's view of scheduled messages, on tiny frames (local Spark): one not due
yet is neither missing nor stuck; one overdue past the SLA is stuck; a record of one still
scheduled, or cancelled, is a phantom."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from outbox.spark_jobs import discrepancies as d
from outbox.spark_jobs.window import AuditWindow, uuid7_floor

T0 = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
WINDOW = AuditWindow.day(T0.date())
AS_OF = datetime(2026, 11, 22, 1, 0, 0, tzinfo=UTC)
RULES = d.AuditRules(WINDOW, AS_OF, stuck_after=timedelta(hours=2))
NAMES: dict[str, str] = {}


def mid(name: str) -> str:
    value = str(uuid.UUID(int=uuid7_floor(T0).int | (len(NAMES) + 1)))
    NAMES[value] = name
    return value


AHEAD, OVERDUE, LATELY_DUE = mid("due next week"), mid("overdue 3h"), mid("due 1h ago")
EARLY, CANCELLED, CANCELLED_QUIET = mid("sent early"), mid("cancelled, sent"), mid("cancelled")


def test_scheduled_messages_are_judged_from_when_they_are_due(spark) -> None:  # type: ignore[no-untyped-def]
    def row(message: str, status: str, due: datetime):  # type: ignore[no-untyped-def]
        # As the JDBC source reads it: a message still scheduled waits from its due time.
        return (message, "orders", b"k", "h", status, due, None, None, None)

    outbox = spark.createDataFrame(
        [
            row(AHEAD, "scheduled", AS_OF + timedelta(days=7)),
            row(OVERDUE, "scheduled", AS_OF - timedelta(hours=3)),
            row(LATELY_DUE, "scheduled", AS_OF - timedelta(hours=1)),
            row(EARLY, "scheduled", AS_OF + timedelta(days=1)),
            row(CANCELLED, "cancelled", T0),
            row(CANCELLED_QUIET, "cancelled", T0),
        ],
        "message_id string, topic string, key binary, value_hash string, status string, "
        "created_at timestamp, sent_at timestamp, kafka_partition int, kafka_offset long",
    )
    topic = spark.createDataFrame(
        [
            (EARLY, "orders", 0, 0, b"k", "h", T0),
            (CANCELLED, "orders", 0, 1, b"k", "h", T0),
        ],
        "message_id string, topic string, partition int, offset long, key binary, "
        "value_hash string, timestamp timestamp",
    )
    found = d.find(d.match(outbox, topic), RULES).collect()
    got = sorted((r["class"], NAMES[r.message_id], r.detail.split(";")[0]) for r in found)
    assert got == [
        ("phantom", "cancelled, sent", "cancelled"),
        ("phantom", "sent early", "scheduled, not pending yet"),
        ("stuck", "overdue 3h", "scheduled, due for 10800s"),
    ]
