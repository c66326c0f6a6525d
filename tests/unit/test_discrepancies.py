"""Each discrepancy class on tiny frames (local Spark)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from outbox.spark_jobs import discrepancies as d
from outbox.spark_jobs.window import AuditWindow, uuid7_floor

T0 = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
WINDOW = AuditWindow.day(T0.date(), grace=timedelta(minutes=15))
AS_OF = datetime(2026, 11, 22, 1, 0, 0, tzinfo=UTC)
RULES = d.AuditRules(WINDOW, AS_OF, stuck_after=timedelta(hours=2), late_after=timedelta(minutes=5))
NAMES: dict[str, str] = {}


def mid(name: str, made: datetime = T0) -> str:
    """A UUIDv7 made at ``made``; the name is kept to read failures back."""
    serial = len(NAMES) + 1
    value = str(uuid.UUID(int=uuid7_floor(made).int | serial))
    NAMES[value] = name
    return value


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


OK, LOST, TWICE, ALTERED = mid("ok"), mid("lost"), mid("twice"), mid("altered")
MOVED, REKEYED, SHIFTED, SLOW = mid("moved"), mid("rekeyed"), mid("shifted"), mid("slow")
WAITING, RECENT = mid("waiting"), mid("recent", AS_OF - timedelta(hours=1, minutes=30))
UNCHECKED = mid("unchecked")
GHOST = mid("ghost")
EARLY_ROW = mid("early row", WINDOW.start - timedelta(minutes=10))
EARLY_GHOST = mid("early ghost", WINDOW.start - timedelta(minutes=10))
DEAD = mid("dead")
# Prepared messages: rolled back yet on the topic, prepared (not committed) yet on the topic,
# prepared past the SLA, prepared recently, rolled back and nowhere.
ROLLED_GHOST, HALF_GHOST = mid("rolled-back ghost"), mid("prepared ghost")
HALF, HALF_RECENT, ROLLED = mid("prepared"), mid("prepared recently"), mid("rolled back")


@pytest.fixture(scope="module")
def matched(spark):  # type: ignore[no-untyped-def]
    def sent(mid_: str, hash_: str, offset: int, *, key: bytes = b"k", after: float = 1.0):  # type: ignore[no-untyped-def]
        return (mid_, "orders", key, hash_, "sent", T0, at(after), 0, offset)

    outbox = spark.createDataFrame(
        [
            sent(OK, "h1", 0),
            sent(LOST, "h2", 1),
            sent(TWICE, "h3", 2),
            sent(ALTERED, "h4", 4),
            sent(MOVED, "h5", 5),
            sent(REKEYED, "h6", 8),
            sent(SHIFTED, "h7", 9),
            sent(SLOW, "h8", 11, after=7200),
            (WAITING, "orders", b"k", "h9", "pending", T0, None, None, None),
            (DEAD, "orders", b"k", "h9", "dead", T0, None, None, None),
            (RECENT, "orders", b"k", "h9", "pending", AS_OF - timedelta(hours=1), None, None, None),
            # Sent after the run started: its record may lie past what was read.
            (UNCHECKED, "orders", b"k", "hA", "sent", T0, AS_OF + timedelta(seconds=5), 0, 99),
            # Made in the grace period before the window: read, but not judged.
            (EARLY_ROW, "orders", b"k", "hB", "sent", T0, at(1), 0, 98),
            (ROLLED_GHOST, "orders", b"k", "hR", "rolled_back", T0, None, None, None),
            (HALF_GHOST, "orders", b"k", "hP", "prepared", T0, None, None, None),
            (HALF, "orders", b"k", "hH", "prepared", T0, None, None, None),
            (
                HALF_RECENT,
                "orders",
                b"k",
                "hH",
                "prepared",
                AS_OF - timedelta(hours=1),
                None,
                None,
                None,
            ),
            (ROLLED, "orders", b"k", "hH", "rolled_back", T0, None, None, None),
        ],
        "message_id string, topic string, key binary, value_hash string, status string, "
        "created_at timestamp, sent_at timestamp, kafka_partition int, kafka_offset long",
    )
    topic = spark.createDataFrame(
        [
            (OK, "orders", 0, 0, b"k", "h1", at(1)),
            (TWICE, "orders", 0, 2, b"k", "h3", at(1)),
            (TWICE, "orders", 0, 3, b"k", "h3", at(2)),
            (ALTERED, "orders", 0, 4, b"k", "CHANGED", at(1)),
            (MOVED, "payments", 0, 0, b"k", "h5", at(1)),
            (REKEYED, "orders", 0, 8, b"other", "h6", at(1)),
            (SHIFTED, "orders", 0, 10, b"k", "h7", at(1)),
            (SLOW, "orders", 0, 11, b"k", "h8", at(7200)),
            (GHOST, "orders", 0, 12, b"k", "hG", at(1)),
            (EARLY_GHOST, "orders", 0, 13, b"k", "hG", at(1)),
            ("not-a-uuid", "orders", 0, 14, b"k", "hX", at(1)),
            (ROLLED_GHOST, "orders", 0, 15, b"k", "hR", at(1)),
            (HALF_GHOST, "orders", 0, 16, b"k", "hP", at(1)),
        ],
        "message_id string, topic string, partition int, offset long, key binary, "
        "value_hash string, timestamp timestamp",
    )
    assert tuple(outbox.columns) == d.OUTBOX_COLUMNS
    assert tuple(topic.columns) == d.TOPIC_COLUMNS
    return d.match(outbox, topic).cache()


def names(frame) -> list[str]:  # type: ignore[no-untyped-def]
    assert frame.schema == d.DISCREPANCY_SCHEMA
    return sorted(NAMES.get(row.message_id, row.message_id) for row in frame.collect())


def test_missing_is_a_sent_row_on_no_topic(matched) -> None:  # type: ignore[no-untyped-def]
    rows = d.missing(matched, RULES).collect()
    assert [(NAMES[r.message_id], r.detail) for r in rows] == [
        ("lost", "recorded at orders/0/1, on no topic")
    ]


def test_duplicate_counts_every_copy(matched) -> None:  # type: ignore[no-untyped-def]
    rows = d.duplicates(matched, RULES).collect()
    assert [(NAMES[r.message_id], r.detail) for r in rows] == [
        ("twice", "2 copies: orders/0/2, orders/0/3")
    ]


def test_phantom_is_an_in_window_record_without_a_committed_row(matched) -> None:  # type: ignore[no-untyped-def]
    # A record whose id is not a UUIDv7 is placed in time by its timestamp.
    rows = {
        NAMES.get(r.message_id, r.message_id): r.detail
        for r in d.phantoms(matched, RULES).collect()
    }
    assert rows == {
        "ghost": "no outbox row; at orders/0/12",
        "not-a-uuid": "no outbox row; at orders/0/14",
        "rolled-back ghost": "rolled back; at orders/0/15",
        "prepared ghost": "prepared, not committed; at orders/0/16",
    }


def test_payload_mismatch(matched) -> None:  # type: ignore[no-untyped-def]
    assert names(d.payload_mismatches(matched, RULES)) == ["altered"]


def test_misrouted_by_topic_or_key(matched) -> None:  # type: ignore[no-untyped-def]
    rows = {NAMES[r.message_id]: r.detail for r in d.misrouted(matched, RULES).collect()}
    assert rows == {
        "moved": "expected on orders with its key; found at payments/0/0",
        "rekeyed": "expected on orders with its key; found at orders/0/8",
    }


def test_offset_mismatch_only_when_found_elsewhere_on_its_topic(matched) -> None:  # type: ignore[no-untyped-def]
    # lost is missing and moved misrouted: each fault is reported once, in its own class.
    rows = d.offset_mismatches(matched, RULES).collect()
    assert [(NAMES[r.message_id], r.detail) for r in rows] == [
        ("shifted", "recorded at orders/0/9, found at orders/0/10")
    ]


def test_stuck_pending_dead_or_prepared_past_the_sla(matched) -> None:  # type: ignore[no-untyped-def]
    rows = {NAMES[r.message_id]: r.detail for r in d.stuck(matched, RULES).collect()}
    assert rows == {
        "waiting": "pending for 46800s",
        "dead": "dead for 46800s",
        "prepared": "prepared for 46800s",
        "prepared ghost": "prepared for 46800s",
    }


def test_prepared_and_rolled_back_messages_are_never_missing(matched) -> None:  # type: ignore[no-untyped-def]
    every = {(r["class"], NAMES.get(r.message_id)) for r in d.find(matched, RULES).collect()}
    uncommitted = {"rolled-back ghost", "prepared ghost", "prepared", "prepared recently"}
    assert not {name for cls, name in every if cls == d.MISSING} & (uncommitted | {"rolled back"})
    # A rolled-back message on no topic, and one prepared within the SLA, are as they should be.
    assert not {name for _, name in every} & {"rolled back", "prepared recently"}


def test_late_sent_past_the_sla(matched) -> None:  # type: ignore[no-untyped-def]
    rows = {NAMES[r.message_id]: r.detail for r in d.late(matched, RULES).collect()}
    assert rows == {"slow": "sent 7200.0s after commit", "unchecked": "sent 46805.0s after commit"}


def test_find_is_the_union_of_the_classes(matched) -> None:  # type: ignore[no-untyped-def]
    every = sorted((r["class"], r.message_id) for r in d.find(matched, RULES).collect())
    one_by_one = sorted(
        (r["class"], r.message_id)
        for finder in (
            d.missing, d.duplicates, d.phantoms, d.payload_mismatches,
            d.misrouted, d.offset_mismatches, d.stuck, d.late,
        )
        for r in finder(matched, RULES).collect()
    )  # fmt: skip
    assert every == one_by_one
    assert {c for c, _ in every} == set(d.CLASSES)
    assert all(NAMES.get(m) not in {"ok", "early row", "early ghost"} for _, m in every)
    # Sent after the run started, it is not judged missing, though its record was not read.
    assert (d.MISSING, UNCHECKED) not in every


def test_counts_per_class_and_topic(matched) -> None:  # type: ignore[no-untyped-def]
    counts = {
        (r["class"], r.topic): r["count"]
        for r in d.count_by_class_and_topic(d.find(matched, RULES)).collect()
    }
    assert counts[("phantom", "orders")] == 4  # two without a row, one rolled back, one prepared
    assert counts[("misrouted", "orders")] == 2
    assert sum(counts.values()) == 16


def test_a_clean_pair_of_frames_has_no_discrepancy(spark) -> None:  # type: ignore[no-untyped-def]
    one = mid("clean")
    outbox = spark.createDataFrame(
        [(one, "orders", b"k", "h", "sent", T0, at(1), 2, 7)],
        "message_id string, topic string, key binary, value_hash string, status string, "
        "created_at timestamp, sent_at timestamp, kafka_partition int, kafka_offset long",
    )
    topic = spark.createDataFrame(
        [(one, "orders", 2, 7, b"k", "h", at(1))],
        "message_id string, topic string, partition int, offset long, key binary, "
        "value_hash string, timestamp timestamp",
    )
    assert d.find(d.match(outbox, topic), RULES).count() == 0


def test_id_time_reads_the_uuid7_millisecond(spark) -> None:  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    made = datetime(2026, 11, 21, 8, 30, 15, 123000, tzinfo=UTC)
    frame = spark.createDataFrame(
        [(str(uuid7_floor(made)),), (str(uuid.uuid4()),), ("junk",)], "id string"
    )
    got = [r.t for r in frame.select(d.id_time(F.col("id")).alias("t")).collect()]
    assert got[0].replace(tzinfo=UTC) == made
    assert got[1:] == [None, None]


def test_unknown_class_is_refused(matched) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="unknown discrepancy classes"):
        d.find(matched, RULES, ["lost-ish"])
