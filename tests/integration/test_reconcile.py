"""The reconciliation job on real PostgreSQL + Kafka + Spark: every injected fault is found,
nothing else is, the archive sources agree with Kafka, repair gives a clean second run, and
prepared messages are judged by what became of them."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from outbox import ID_HEADER, Outbox
from outbox.ids import uuid7
from outbox.prepared import PreparedMessages
from outbox.spark_jobs import discrepancies as d
from outbox.spark_jobs.progress import Progress
from outbox.spark_jobs.reconcile import ReconcileConfig, run
from outbox.spark_jobs.window import AuditWindow
from tests.relay_helpers import publish_orders, relay_config, running_relay, statuses, wait_for

pytestmark = pytest.mark.integration


def relay_until_sent(outbox_url: str, bootstrap: str, engine: sa.Engine, count: int) -> None:
    with running_relay(relay_config(outbox_url, bootstrap)):
        wait_for(lambda: statuses(engine).get("sent", 0) >= count, 60, f"{count} rows sent")


def window_around_now() -> AuditWindow:
    now = datetime.now(UTC)
    return AuditWindow(
        now - timedelta(minutes=30), now + timedelta(minutes=1), timedelta(minutes=1)
    )


def records_of(bootstrap: str, topic: str, partitions: int) -> list:  # type: ignore[type-arg]
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    found = []
    idle = 0
    while idle < 3:
        batch = consumer.consume(500, timeout=1)
        idle = 0 if batch else idle + 1
        found.extend(r for r in batch if r.error() is None)
    consumer.close()
    return found


def row_of(engine: sa.Engine, partition: int, offset: int) -> uuid.UUID:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT id FROM outbox WHERE kafka_partition = :p AND kafka_offset = :o"),
            {"p": partition, "o": offset},
        ).scalar_one()


def inject_faults(engine: sa.Engine, bootstrap: str, topic: str) -> dict[str, set[str]]:
    """One fault of each class, each on its own message; returns the ids expected per class."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    # missing: the first three records of partition 0 are deleted on the broker.
    lost = {str(row_of(engine, 0, o)) for o in range(3)}
    admin.delete_records([TopicPartition(topic, 0, 3)])[TopicPartition(topic, 0, 3)].result(30)

    records = {str(uuid.UUID(dict(r.headers())[ID_HEADER].decode())): r for r in records_of(
        bootstrap, topic, 3
    )}  # fmt: skip
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    # duplicate: a second copy of a record, as a retry without idempotence would make.
    twice = str(row_of(engine, 1, 0))
    original = records[twice]
    producer.produce(
        topic, original.value(), original.key(), partition=1, headers=original.headers()
    )
    # phantom: a record with a valid-looking outbox id that no row has.
    ghost = str(uuid7())
    producer.produce(
        topic, b'{"n": -1}', b"key-1", partition=2, headers=[(ID_HEADER, ghost.encode())]
    )
    assert producer.flush(30) == 0

    altered, moved, shifted = (str(row_of(engine, 1, o)) for o in (1, 2, 3))
    slow = str(row_of(engine, 2, 0))
    with engine.begin() as conn:
        # payload mismatch: the row no longer says what was published.
        conn.execute(sa.text("UPDATE outbox SET value = 'tampered' WHERE id = :i"), {"i": altered})
        # misrouted: the row says another topic than the record is on.
        conn.execute(sa.text("UPDATE outbox SET topic = 'elsewhere' WHERE id = :i"), {"i": moved})
        # offset mismatch: the recorded offset does not hold the message.
        conn.execute(
            sa.text("UPDATE outbox SET kafka_offset = kafka_offset + 1000 WHERE id = :i"),
            {"i": shifted},
        )
        # late: committed ten minutes before it was sent.
        conn.execute(
            sa.text("UPDATE outbox SET created_at = sent_at - interval '10 minutes' WHERE id = :i"),
            {"i": slow},
        )
    # stuck: committed two hours ago and never sent (no relay runs now).
    stuck_id = str(publish_orders(engine, topic, 1, start=10_000)[0])
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET created_at = now() - interval '2 hours' WHERE id = :i"),
            {"i": stuck_id},
        )
    return {
        d.MISSING: lost,
        d.DUPLICATE: {twice},
        d.PHANTOM: {ghost},
        d.PAYLOAD_MISMATCH: {altered},
        d.MISROUTED: {moved},
        d.OFFSET_MISMATCH: {shifted},
        d.LATE: {slow},
        d.STUCK: {stuck_id},
    }


def found_ids(spark, output: str) -> dict[str, set[str]]:  # type: ignore[no-untyped-def]
    found: dict[str, set[str]] = {}
    for row in spark.read.parquet(f"{output}/discrepancies").collect():
        found.setdefault(row["class"], set()).add(row.message_id)
    return found


def write_archives(spark, bootstrap: str, topic: str, root: Path) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """The topic as a sink connector would archive it: Parquet, and JSON lines with base64."""
    raw = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("includeHeaders", "true")
        .option("startingOffsets", "earliest")
        .load()
        .select("topic", "partition", "offset", "timestamp", "key", "value", "headers")
    )
    parquet = str(root / "parquet")
    raw.write.parquet(parquet)
    lines = []
    for r in raw.collect():
        lines.append(
            json.dumps(
                {
                    "topic": r.topic,
                    "partition": r.partition,
                    "offset": r.offset,
                    "timestamp": int(r.timestamp.replace(tzinfo=UTC).timestamp() * 1000),
                    "key": base64.b64encode(r.key).decode() if r.key is not None else None,
                    "value": base64.b64encode(r.value).decode() if r.value is not None else None,
                    "headers": [
                        {"key": h.key, "value": base64.b64encode(h.value).decode()}
                        for h in r.headers or []
                    ],
                }
            )
        )
    jsonl = root / "json"
    jsonl.mkdir()
    (jsonl / f"{topic}+0.jsonl").write_text("\n".join(lines) + "\n")
    return parquet, str(jsonl)


def test_each_injected_fault_is_found_exactly_from_kafka_and_from_archives(
    spark, outbox_url, engine, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("recon", partitions=3)
    publish_orders(engine, topic, 120, keys=12)
    relay_until_sent(outbox_url, bootstrap_servers, engine, 120)
    expected = inject_faults(engine, bootstrap_servers, topic)

    window = window_around_now()
    quiet = Progress(spark.sparkContext, out=io.StringIO())
    common = {"database_url": outbox_url, "window": window, "jdbc_slices": 3}
    from_kafka = run(
        spark,
        ReconcileConfig(
            output=str(tmp_path / "kafka"),
            bootstrap_servers=bootstrap_servers,
            **common,  # type: ignore[arg-type]
        ),
        quiet,
    )
    assert found_ids(spark, str(tmp_path / "kafka")) == expected
    assert from_kafka.per_class() == {name: len(ids) for name, ids in expected.items()}
    assert from_kafka.outbox_rows == 121
    # 120 published - 3 deleted + a duplicate + a phantom
    assert from_kafka.topic_records == 119
    assert from_kafka.exit_code == 1 and set(from_kafka.breaches()) == set(d.CLASSES)
    assert set(from_kafka.topics) == {topic, "elsewhere"}
    summary = json.loads((tmp_path / "kafka" / "summary.json").read_text())
    assert summary["discrepancies"]["missing"] == 3 and summary["verdict"] == "fail"

    parquet, jsonl = write_archives(spark, bootstrap_servers, topic, tmp_path)
    for path, fmt in ((parquet, "parquet"), (jsonl, "json")):
        out = str(tmp_path / fmt / "out")
        archived = run(
            spark,
            ReconcileConfig(
                output=out, source="archive", archive_path=path, archive_format=fmt, **common
            ),  # type: ignore[arg-type]
            quiet,
        )
        assert found_ids(spark, out) == expected, fmt
        assert archived.topic_records == from_kafka.topic_records


def reconcile_now(spark, outbox_url: str, bootstrap: str, output: Path, **options: Any):  # type: ignore[no-untyped-def]
    """One run in this process over the last half hour, read from Kafka."""
    config = ReconcileConfig(
        database_url=outbox_url,
        window=window_around_now(),
        output=str(output),
        bootstrap_servers=bootstrap,
        jdbc_slices=2,
        **options,
    )
    return run(spark, config, Progress(spark.sparkContext, out=io.StringIO()))


def reconcile_cli(outbox_url: str, bootstrap: str, output: Path, *extra: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    window = window_around_now()
    result = subprocess.run(
        [
            sys.executable, "-m", "outbox.cli", "reconcile",
            "--database-url", outbox_url, "--bootstrap-servers", bootstrap,
            "--start", window.start.isoformat(), "--end", window.end.isoformat(), "--grace", "1m",
            "--output", str(output), "--master", "local[2]", "--driver-memory", "1g",
            "--jdbc-slices", "2", "--json", *extra,
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert "verdict:" in result.stdout
    assert "reading the outbox and the topics" in result.stderr  # the progress indication
    return result.returncode, json.loads(lines[-1])


def test_repair_requeues_missing_messages_once_and_the_next_run_is_clean(
    spark, outbox_url, engine, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("repair", partitions=2)
    publish_orders(engine, topic, 60, keys=6)
    relay_until_sent(outbox_url, bootstrap_servers, engine, 60)
    lost = {row_of(engine, 0, o) for o in range(4)}
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})  # kept: it runs the future
    admin.delete_records([TopicPartition(topic, 0, 4)])[TopicPartition(topic, 0, 4)].result(30)

    code, first = reconcile_cli(
        outbox_url, bootstrap_servers, tmp_path / "first", "--repair", "--runs-table", "recon_runs"
    )
    assert code == 1
    assert first["discrepancies"] == {**dict.fromkeys(d.CLASSES, 0), "missing": 4}
    assert first["repaired"] == 4
    with engine.connect() as conn:
        pending = set(
            conn.execute(sa.text("SELECT id FROM outbox WHERE status = 'pending'")).scalars()
        )
        note = conn.execute(
            sa.text("SELECT last_error FROM outbox WHERE status = 'pending' LIMIT 1")
        ).scalar_one()
    assert pending == lost
    assert note.startswith("requeued by reconciliation: recorded at ")

    # Again before the relay ran: nothing is missing any more, nothing more changes.
    again = reconcile_now(spark, outbox_url, bootstrap_servers, tmp_path / "again", repair=True)
    assert again.repaired == 0 and again.passed

    relay_until_sent(outbox_url, bootstrap_servers, engine, 60)
    code, clean = reconcile_cli(
        outbox_url, bootstrap_servers, tmp_path / "clean", "--runs-table", "recon_runs"
    )
    assert code == 0, clean
    assert sum(clean["discrepancies"].values()) == 0 and clean["verdict"] == "pass"
    assert clean["outbox_rows"] == 60 and clean["topic_records"] == 60
    with engine.connect() as conn:
        runs = conn.execute(
            sa.text("SELECT verdict, discrepancies, repaired FROM recon_runs ORDER BY started_at")
        ).all()
    assert [tuple(r) for r in runs] == [("fail", 4, 4), ("pass", 0, None)]


def test_prepared_messages_rolled_back_yet_on_a_topic_are_phantoms_and_old_ones_stuck(
    spark, outbox_url, engine, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A prepared message committed late is judged from its commit; one rolled back and
    nowhere, or prepared within the SLA, is fine; one rolled back yet found on its topic (a
    sender that published it anyway) is a phantom; one prepared past the SLA is stuck.
    Neither is missing."""
    topic = make_topic("recon-prep")
    prepared = PreparedMessages(Outbox(engine))
    committed, rolled_back, leaked, old, recent = (
        prepared.prepare(topic, {"n": n}, key=n) for n in range(5)
    )
    with engine.begin() as conn:  # prepared two hours ago, and never decided
        conn.execute(
            sa.text(
                "UPDATE outbox SET prepared_at = now() - interval '2 hours',"
                " created_at = now() - interval '2 hours' WHERE id = :i"
            ),
            {"i": old.message_id},
        )
    committed.commit()
    rolled_back.rollback()
    leaked.rollback()
    relay_until_sent(outbox_url, bootstrap_servers, engine, 1)
    with engine.connect() as conn:
        value = conn.execute(
            sa.text("SELECT value FROM outbox WHERE id = :i"), {"i": leaked.message_id}
        ).scalar_one()
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    producer.produce(topic, value, b"2", headers=[(ID_HEADER, str(leaked.message_id).encode())])
    assert producer.flush(30) == 0

    summary = reconcile_now(spark, outbox_url, bootstrap_servers, tmp_path / "run")
    assert found_ids(spark, str(tmp_path / "run")) == {
        d.PHANTOM: {str(leaked.message_id)},
        d.STUCK: {str(old.message_id)},
    }
    details = {
        row["class"]: row.detail
        for row in spark.read.parquet(str(tmp_path / "run" / "discrepancies")).collect()
    }
    assert details[d.PHANTOM].startswith("rolled back; at ")
    assert details[d.STUCK].startswith("prepared for ")
    assert summary.outbox_rows == 5 and summary.topic_records == 2
    assert str(recent.message_id) not in str(details)


def test_unreachable_services_and_bad_options_are_one_clear_line(outbox_url, tmp_path) -> None:  # type: ignore[no-untyped-def]
    def reconcile(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "outbox.cli", "reconcile", "--output", str(tmp_path), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    bad_db = reconcile(
        "--database-url", "postgresql+psycopg://u:hidden-pw@127.0.0.1:1/x",
        "--bootstrap-servers", "127.0.0.1:1",
    )  # fmt: skip
    assert bad_db.returncode == 2
    assert bad_db.stderr.startswith("Error: cannot read public.outbox:")
    assert len(bad_db.stderr.strip().splitlines()) == 1 and "hidden-pw" not in bad_db.stderr

    no_kafka = reconcile("--database-url", outbox_url, "--bootstrap-servers", "127.0.0.1:1")
    assert no_kafka.returncode == 2
    assert no_kafka.stderr.startswith("Error: cannot reach Kafka at 127.0.0.1:1")

    bad_limit = reconcile("--database-url", outbox_url, "--source", "archive", "--archive", "x",
                          "--max", "lost=3")  # fmt: skip
    assert bad_limit.returncode == 2 and "expected CLASS=COUNT" in bad_limit.stderr
    bad_window = reconcile("--database-url", outbox_url, "--source", "archive", "--archive", "x",
                           "--start", "2026-11-22", "--end", "2026-11-21")  # fmt: skip
    assert bad_window.returncode == 2 and "before it starts" in bad_window.stderr
