"""The reconciliation on real PostgreSQL + Kafka + Spark: messages sent after their window's
read ends (late, or sent again after a repair) are still judged, and a repair is refused when
the clocks are so far apart that what looks missing may be records the read did not reach."""

from __future__ import annotations

import io
import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from confluent_kafka import Message, Producer

from outbox import ID_HEADER
from outbox.schema import shard_of
from outbox.spark_jobs import discrepancies as d
from outbox.spark_jobs.progress import Progress
from outbox.spark_jobs.reconcile import ReconcileConfig, run
from outbox.spark_jobs.window import AuditWindow

pytestmark = pytest.mark.integration


def id_made_at(moment: datetime) -> uuid.UUID:
    """A UUIDv7 made at ``moment``, as the publish API would have made it then."""
    millis = int(moment.timestamp() * 1000)
    return uuid.UUID(
        int=(millis << 80) | (0x7 << 76) | (random.getrandbits(12) << 64) | (0b10 << 62)
        | random.getrandbits(62)
    )  # fmt: skip


def produce(bootstrap: str, topic: str, message_id: uuid.UUID, stamp: datetime | None) -> Message:
    """The record the relay would have produced, stamped ``stamp`` (its host's clock)."""
    delivered: list[Message] = []
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    producer.produce(
        topic,
        b'{"n": 1}',
        b"k",
        headers=[(ID_HEADER, str(message_id).encode())],
        timestamp=int(stamp.timestamp() * 1000) if stamp else 0,
        on_delivery=lambda error, message: delivered.append(message),
    )
    assert producer.flush(30) == 0 and delivered[0].error() is None
    return delivered[0]


def insert_sent(
    engine: sa.Engine, topic: str, message_id: uuid.UUID, record: Message | None
) -> None:
    """An outbox row marked sent now, at the record's place (or at a place holding nothing)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox (id, shard, topic, key, value, status, created_at, sent_at,"
                " kafka_partition, kafka_offset) VALUES (:id, :shard, :topic, 'k',"
                " CAST('{\"n\": 1}' AS bytea), 'sent', :made, now(), :partition, :offset)"
            ),
            {
                "id": message_id,
                "shard": shard_of(b"k", message_id),
                "topic": topic,
                "made": datetime.fromtimestamp((message_id.int >> 80) / 1000, UTC),
                "partition": record.partition() if record else 0,
                "offset": record.offset() if record else 999_999,
            },
        )


def audit(spark, outbox_url: str, bootstrap: str, window: AuditWindow, tmp_path, **options):  # type: ignore[no-untyped-def]
    return run(
        spark,
        ReconcileConfig(
            database_url=outbox_url,
            window=window,
            output=str(tmp_path / uuid.uuid4().hex[:8]),
            bootstrap_servers=bootstrap,
            jdbc_slices=2,
            **options,
        ),
        Progress(spark.sparkContext, out=io.StringIO()),
    )


def missing_ids(spark, summary) -> set[str]:  # type: ignore[no-untyped-def]
    rows = spark.read.parquet(summary.output).where(f"class = '{d.MISSING}'").collect()
    return {row.message_id for row in rows}


def test_messages_sent_after_their_window_are_still_judged(
    spark, outbox_url, engine, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """As after a repair: rows of a past window sent again only now."""
    topic = make_topic("late")
    now = datetime.now(UTC)
    window = AuditWindow(now - timedelta(hours=3), now - timedelta(hours=2), timedelta(minutes=1))
    made = now - timedelta(hours=2, minutes=30)
    resent, marked_only = id_made_at(made), id_made_at(made + timedelta(seconds=1))
    insert_sent(engine, topic, resent, produce(bootstrap_servers, topic, resent, None))
    insert_sent(engine, topic, marked_only, None)  # marked sent, on no topic

    summary = audit(spark, outbox_url, bootstrap_servers, window, tmp_path)
    assert missing_ids(spark, summary) == {str(marked_only)}
    assert summary.per_class()[d.MISSING] == 1 and summary.per_class()[d.OFFSET_MISMATCH] == 0
    assert summary.window.records_read_until > window.read_until
    assert summary.to_json()["records_read_until"] == summary.window.records_read_until.isoformat()


def test_repair_is_refused_when_the_clocks_are_further_apart_than_half_the_grace(
    spark, outbox_url, engine, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("skew")
    now = datetime.now(UTC)
    window = AuditWindow(
        now - timedelta(minutes=5), now + timedelta(minutes=1), timedelta(minutes=1)
    )
    # The producing host's clock runs 3 minutes behind the writers': a record of a message made
    # near the window's start is stamped before the read begins, and looks missing.
    early = id_made_at(now - timedelta(minutes=4, seconds=30))
    insert_sent(
        engine,
        topic,
        early,
        produce(bootstrap_servers, topic, early, now - timedelta(minutes=7, seconds=30)),
    )
    recent = id_made_at(now - timedelta(seconds=10))
    insert_sent(
        engine,
        topic,
        recent,
        produce(bootstrap_servers, topic, recent, now - timedelta(minutes=3, seconds=10)),
    )

    refused = audit(spark, outbox_url, bootstrap_servers, window, tmp_path, repair=True)
    assert missing_ids(spark, refused) == {str(early)}
    assert refused.repair_refused and "behind" in refused.repair_refused
    assert refused.repaired is None and refused.exit_code == 3
    measured = refused.to_json()["clock_seconds"]
    assert -185 < measured["record_behind_id"] < -175
    with engine.connect() as conn:
        assert (
            conn.execute(sa.text("SELECT count(*) FROM outbox WHERE status <> 'sent'")).scalar()
            == 0
        )

    forced = audit(
        spark,
        outbox_url,
        bootstrap_servers,
        window,
        tmp_path,
        repair=True,
        repair_despite_skew=True,
    )
    assert forced.repaired == 1 and forced.repair_refused is None
    assert forced.clock_skew is not None  # still reported
