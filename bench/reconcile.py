"""Reconciliation benchmark: the Spark job over N messages next to a single-node SQL baseline.

For each size N (default 1M, 3M, 10M), on one stack, in one run:

  data        N sent outbox rows for yesterday (UTC) in PostgreSQL, made by SQL, and the topic
              as a Parquet archive made by Spark from the same formulas, with faults planted
              every 100,000 messages: one record left out (missing), one with another value
              (payload mismatch) and one extra record with an id no row has (phantom).
  spark       `outbox.spark_jobs.reconcile.run` against the archive: JDBC read, match, classify,
              write discrepancy rows (local[2], all in-process; the session is started once).
  baseline    the same audit done by PostgreSQL alone: COPY the topic export (CSV, made
              beforehand) into a table, then one SQL statement counting every class.
  kafka       for the first size only: the records produced to a Kafka topic, and the job
              run against Kafka instead of the archive.

Both sides must find exactly the planted faults, or the run fails. The last line is one JSON
object with the figures.

Run: make bench-reconcile   (BENCH_ARGS="--sizes 100000,300000" for a quick run)
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import sqlalchemy as sa
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from bench.stack import bench_stack, machine
from outbox import ID_HEADER, migrate
from outbox.devstack.stack import spark_jars, stack_home
from outbox.spark_jobs import discrepancies as d
from outbox.spark_jobs.progress import Progress
from outbox.spark_jobs.reconcile import ReconcileConfig, run
from outbox.spark_jobs.session import build_session
from outbox.spark_jobs.window import AuditWindow

TOPIC = "bench-orders"
VERBOSE = False
PARTITIONS = 8
FAULT_EVERY = 100_000
LOST, ALTERED, GHOST = 7, 11, 13  # residues of i % FAULT_EVERY that carry a fault


def planted(n: int) -> dict[str, int]:
    faults = sum(1 for base in range(0, n, FAULT_EVERY) if base + LOST < n)
    return {d.MISSING: faults, d.PAYLOAD_MISMATCH: faults, d.PHANTOM: faults}


# The message formulas, written once for PostgreSQL and once for Spark; both must agree.
PG_ROWS = """
INSERT INTO outbox (id, shard, topic, key, value, status, attempts, created_at, sent_at,
                    kafka_partition, kafka_offset)
SELECT (substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7000-8000-'
        || lpad(to_hex(i), 12, '0'))::uuid,
       (i %% 16)::smallint, %(topic)s, convert_to('customer-' || (i %% 1000), 'UTF8'),
       convert_to('{"order_id": ' || i || ', "customer": "customer-' || (i %% 1000)
                  || '", "total_cents": ' || (1000 + i %% 5000) || ', "note": "'
                  || repeat('x', 40) || '"}', 'UTF8'),
       'sent', 1, to_timestamp(ms / 1000.0), to_timestamp((ms + 50) / 1000.0),
       (i %% %(partitions)s)::int, i / %(partitions)s
  FROM (SELECT i, ms, lpad(to_hex(ms), 12, '0') AS h
          FROM (SELECT i, %(start_ms)s::bigint + i * %(span_ms)s::bigint / %(n)s AS ms
                  FROM generate_series(%(low)s::bigint, %(high)s::bigint) AS i) AS timed) AS hexed
"""


def spark_records(spark: SparkSession, n: int, start_ms: int, span_ms: int) -> DataFrame:
    """The topic as archived: one record per message, faults planted, Kafka's columns."""
    i = F.col("id")

    def message_id(index: Column, variant: str) -> Column:
        ms = F.lit(start_ms) + F.expr(f"id * {span_ms} div {n}")
        hexed = F.lpad(F.lower(F.hex(ms)), 12, "0")
        return F.concat(
            F.substring(hexed, 1, 8), F.lit("-"), F.substring(hexed, 9, 4),
            F.lit(f"-7000-{variant}000-"), F.lpad(F.lower(F.hex(index)), 12, "0"),
        )  # fmt: skip

    def value(index: Column) -> Column:
        return F.concat(
            F.lit('{"order_id": '), index.cast("string"),
            F.lit(', "customer": "customer-'), (index % 1000).cast("string"),
            F.lit('", "total_cents": '), (F.lit(1000) + index % 5000).cast("string"),
            F.lit(', "note": "' + "x" * 40 + '"}'),
        )  # fmt: skip

    base = spark.range(0, n, numPartitions=8)
    residue = i % FAULT_EVERY
    records = base.where(residue != LOST).select(
        message_id(i, "8").alias("mid"),
        F.when(residue == ALTERED, F.lit("tampered")).otherwise(value(i)).alias("v"),
        i,
    )
    ghosts = base.where(residue == GHOST).select(
        message_id(i, "9").alias("mid"), value(i).alias("v"), i
    )
    return records.unionByName(ghosts).select(
        F.lit(TOPIC).alias("topic"),
        (i % PARTITIONS).cast("int").alias("partition"),
        (i / PARTITIONS).cast("long").alias("offset"),
        F.timestamp_millis(F.lit(start_ms) + F.expr(f"id * {span_ms} div {n}") + 20).alias(
            "timestamp"
        ),
        F.encode(F.concat(F.lit("customer-"), (i % 1000).cast("string")), "UTF-8").alias("key"),
        F.encode("v", "UTF-8").alias("value"),
        F.array(
            F.struct(F.lit(ID_HEADER).alias("key"), F.encode("mid", "UTF-8").alias("value"))
        ).alias("headers"),
    )


def libpq_url(url: str) -> str:
    """The SQLAlchemy URL as psycopg's own connect() takes it."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(False)


def load_outbox(url: str, n: int, window: AuditWindow, span_ms: int) -> float:
    migrate.upgrade(url)
    conninfo = libpq_url(url)
    started = time.monotonic()
    params = {
        "topic": TOPIC,
        "partitions": PARTITIONS,
        "start_ms": int(window.start.timestamp() * 1000),
        "span_ms": span_ms,
        "n": n,
    }
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for low in range(0, n, 1_000_000):
            conn.execute(PG_ROWS, {**params, "low": low, "high": min(n, low + 1_000_000) - 1})
        conn.execute("VACUUM ANALYZE outbox")
    return time.monotonic() - started


BASELINE_SQL = """
WITH o AS (
  SELECT id, topic, key, md5(value) AS h, status, sent_at, kafka_partition, kafka_offset
    FROM outbox WHERE id >= %(low)s AND id < %(high)s
), t AS (
  SELECT message_id, topic, partition, "offset", key, md5(value) AS h
    FROM topic_export WHERE ts >= %(read_from)s AND ts < %(read_until)s
), per_message AS (
  SELECT coalesce(o.id, t.message_id) AS id,
         bool_or(o.id IS NOT NULL) AS has_row,
         bool_or(o.status = 'sent' AND o.sent_at < %(checked_until)s) AS checkable,
         count(t.message_id) AS copies,
         bool_or(t.h IS DISTINCT FROM o.h) FILTER (WHERE t.message_id IS NOT NULL
                                                   AND o.id IS NOT NULL) AS altered,
         bool_or(t.topic <> o.topic OR t.key IS DISTINCT FROM o.key)
           FILTER (WHERE t.message_id IS NOT NULL AND o.id IS NOT NULL) AS misrouted,
         bool_or(t.topic = o.topic) AS on_own_topic,
         bool_or(t.topic = o.topic AND t.partition = o.kafka_partition
                 AND t."offset" = o.kafka_offset) AS at_recorded
    FROM o FULL JOIN t ON t.message_id = o.id
   GROUP BY 1
)
SELECT count(*) FILTER (WHERE checkable AND copies = 0) AS missing,
       count(*) FILTER (WHERE copies > 1) AS duplicate,
       count(*) FILTER (WHERE NOT has_row AND copies > 0) AS phantom,
       count(*) FILTER (WHERE altered) AS payload_mismatch,
       count(*) FILTER (WHERE has_row AND misrouted) AS misrouted,
       count(*) FILTER (WHERE checkable AND on_own_topic AND NOT at_recorded) AS offset_mismatch
  FROM per_message
 WHERE id >= %(scope_low)s AND id < %(scope_high)s
"""


def export_csv(records: DataFrame, path: Path) -> None:
    """The topic export the baseline loads: bytes as bytea hex, one CSV file per partition."""
    records.select(
        F.expr("headers[0].value").cast("string").alias("message_id"),
        "topic",
        "partition",
        "offset",
        F.date_format("timestamp", "yyyy-MM-dd HH:mm:ss.SSSXXX").alias("ts"),
        F.concat(F.lit("\\x"), F.lower(F.hex("key"))).alias("key"),
        F.concat(F.lit("\\x"), F.lower(F.hex("value"))).alias("value"),
    ).write.mode("overwrite").csv(str(path))


def baseline(url: str, csv_dir: Path, window: AuditWindow, as_of: datetime) -> tuple[float, dict]:  # type: ignore[type-arg]
    """Load the export with COPY and audit with one SQL statement; (seconds, counts)."""
    from outbox.spark_jobs.window import uuid7_floor

    conninfo = libpq_url(url)
    started = time.monotonic()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SET work_mem = '256MB'")
        conn.execute("DROP TABLE IF EXISTS topic_export")
        conn.execute(
            "CREATE UNLOGGED TABLE topic_export (message_id uuid, topic text, partition int,"
            ' "offset" bigint, ts timestamptz, key bytea, value bytea)'
        )
        with conn.cursor() as cur:
            for part in sorted(csv_dir.glob("part-*.csv")):
                with (
                    cur.copy("COPY topic_export FROM STDIN (FORMAT csv)") as copy,
                    part.open("rb") as source,
                ):
                    while chunk := source.read(1 << 20):
                        copy.write(chunk)
        conn.execute("ANALYZE topic_export")
        row = conn.execute(
            BASELINE_SQL,
            {
                "low": uuid7_floor(window.read_from),
                "high": uuid7_floor(window.read_until),
                "read_from": window.read_from,
                "read_until": window.read_until,
                "checked_until": min(window.read_until, as_of),
                "scope_low": uuid7_floor(window.start),
                "scope_high": uuid7_floor(window.end),
            },
        ).fetchone()
        assert row is not None
        names = [
            "missing",
            "duplicate",
            "phantom",
            "payload_mismatch",
            "misrouted",
            "offset_mismatch",
        ]
        counts = dict(zip(names, row, strict=True))
        conn.execute("DROP TABLE topic_export")
    return time.monotonic() - started, counts


def produce_to_kafka(bootstrap: str, records: DataFrame, url: str) -> float:
    """The archive's records produced to a fresh topic with their timestamps; the offsets the
    broker gave them are then recorded on the outbox rows."""
    conninfo = libpq_url(url)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    if TOPIC in admin.list_topics(timeout=10).topics:
        admin.delete_topics([TOPIC])[TOPIC].result(60)
        time.sleep(2)
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])[TOPIC].result(60)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "linger.ms": 20,
            "batch.num.messages": 10_000,
            "queue.buffering.max.messages": 500_000,
        }
    )
    # In order per partition, on a fresh topic, with the idempotent producer: the broker gives
    # each partition's records the offsets 0, 1, 2, ... in the order they are produced.
    acks: list[tuple[str, int, int]] = []
    next_offset = [0] * PARTITIONS
    started = time.monotonic()
    for r in records.orderBy("partition", "offset").toLocalIterator(prefetchPartitions=True):
        message_id = bytes(r.headers[0].value)
        while True:
            try:
                producer.produce(
                    TOPIC,
                    bytes(r.value),
                    bytes(r.key),
                    partition=r.partition,
                    timestamp=int(r.timestamp.replace(tzinfo=UTC).timestamp() * 1000),
                    headers=[(ID_HEADER, message_id)],
                )
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
        acks.append((message_id.decode(), r.partition, next_offset[r.partition]))
        next_offset[r.partition] += 1
    assert producer.flush(120) == 0
    seconds = time.monotonic() - started
    # The broker numbers offsets itself: record them on the rows, as the relay does.
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE acks (id uuid, p int, o bigint)")
        with conn.cursor() as cur, cur.copy("COPY acks FROM STDIN") as copy:
            for ack in acks:
                copy.write_row(ack)
        conn.execute(
            "UPDATE outbox SET kafka_partition = acks.p, kafka_offset = acks.o"
            " FROM acks WHERE outbox.id = acks.id"
        )
        conn.execute("VACUUM ANALYZE outbox")
    return seconds


def reconcile(
    spark: SparkSession, url: str, window: AuditWindow, out: Path, **source: object
) -> tuple[float, dict[str, int], int]:
    config = ReconcileConfig(
        database_url=url,
        window=window,
        output=str(out),
        jdbc_slices=8,
        **source,  # type: ignore[arg-type]
    )
    out_to = sys.stderr if VERBOSE else io.StringIO()
    summary = run(spark, config, Progress(spark.sparkContext, out=out_to))
    return summary.seconds, summary.per_class(), summary.outbox_rows


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,3000000,10000000")
    parser.add_argument("--driver-memory", default="8g")
    parser.add_argument("--warmup", type=int, default=200_000, help="0: no warm-up run")
    parser.add_argument("--verbose", action="store_true", help="show the job's progress")
    args = parser.parse_args(argv)
    global VERBOSE
    VERBOSE = args.verbose
    sizes = [int(s) for s in args.sizes.split(",")]

    window = AuditWindow.yesterday(datetime.now(UTC), grace=timedelta(minutes=15))
    span_ms = int((window.end - window.start).total_seconds() * 1000) - 1
    work = stack_home() / "bench-reconcile"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spark = build_session(
        "outbox-bench-reconcile",
        master="local[2]",
        jars=[str(j) for j in spark_jars()],
        shuffle_partitions=16,
        extra_conf={
            "spark.driver.memory": args.driver_memory,
            "spark.ui.showConsoleProgress": "false",
        },
    )
    spark.sparkContext.setLogLevel("WARN")
    results: dict[str, dict[str, float]] = {}
    kafka: dict[str, float] = {}
    print(f"reconciliation benchmark on {machine()}; window {window.describe()}", flush=True)
    print(
        f"{'N':>11} {'load PG s':>10} {'spark s':>9} {'rows/s':>10} {'baseline s':>11}"
        f" {'baseline/spark':>15}",
        flush=True,
    )
    try:
        with bench_stack("bench-reconcile") as (stack, info):
            if args.warmup:
                # A long-lived driver has its JIT warm; a first, small run stands for that.
                url = stack.postgres.create_database("recon_warmup")
                load_outbox(url, args.warmup, window, span_ms)
                warm = work / "archive-warmup"
                start_ms = int(window.start.timestamp() * 1000)
                spark_records(spark, args.warmup, start_ms, span_ms).write.parquet(str(warm))
                for _ in range(2):
                    reconcile(spark, url, window, work / "out-warmup", source="archive",
                              archive_path=str(warm))  # fmt: skip
                stack.postgres.drop_database("recon_warmup")
            for n in sizes:
                name = f"recon_{n}"
                stack.postgres.drop_database(name)
                url = stack.postgres.create_database(name)
                load_seconds = load_outbox(url, n, window, span_ms)
                start_ms = int(window.start.timestamp() * 1000)
                records = spark_records(spark, n, start_ms, span_ms)
                archive = work / f"archive-{n}"
                records.write.mode("overwrite").parquet(str(archive))
                csv_dir = work / f"export-{n}"
                export_csv(spark.read.parquet(str(archive)), csv_dir)
                expected = {**dict.fromkeys(d.CLASSES, 0), **planted(n)}

                seconds, found, rows = reconcile(
                    spark, url, window, work / f"out-{n}",
                    source="archive", archive_path=str(archive),
                )  # fmt: skip
                if found != expected or rows != n:
                    raise SystemExit(f"spark found {found} over {rows} rows, expected {expected}")
                base_seconds, base_found = baseline(url, csv_dir, window, datetime.now(UTC))
                if any(base_found[k] != expected[k] for k in base_found):
                    raise SystemExit(f"the baseline found {base_found}, expected {expected}")
                results[str(n)] = {
                    "load_outbox_s": round(load_seconds, 1),
                    "spark_s": round(seconds, 1),
                    "rows_per_s": round(n / seconds),
                    "baseline_s": round(base_seconds, 1),
                    "baseline_over_spark": round(base_seconds / seconds, 2),
                }
                r = results[str(n)]
                print(
                    f"{n:>11,} {load_seconds:>10.1f} {seconds:>9.1f} {r['rows_per_s']:>10,}"
                    f" {base_seconds:>11.1f} {r['baseline_over_spark']:>15.2f}",
                    flush=True,
                )
                if n == sizes[0]:
                    produce_seconds = produce_to_kafka(
                        info.bootstrap_servers, spark.read.parquet(str(archive)), url
                    )
                    k_seconds, k_found, _ = reconcile(
                        spark, url, window, work / f"out-kafka-{n}",
                        source="kafka", bootstrap_servers=info.bootstrap_servers,
                    )  # fmt: skip
                    if k_found != expected:
                        raise SystemExit(f"from Kafka: found {k_found}, expected {expected}")
                    kafka = {
                        "n": n,
                        "produce_s": round(produce_seconds, 1),
                        "spark_s": round(k_seconds, 1),
                        "rows_per_s": round(n / k_seconds),
                    }
                    print(
                        f"{n:>11,} from Kafka: spark {k_seconds:.1f}s"
                        f" ({kafka['rows_per_s']:,} rows/s;"
                        f" producing the topic took {produce_seconds:.1f}s)",
                        flush=True,
                    )
                stack.postgres.drop_database(name)
                shutil.rmtree(archive)
                shutil.rmtree(csv_dir)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)

    first, last = str(sizes[0]), str(sizes[-1])
    growth = (results[last]["spark_s"] / results[first]["spark_s"]) / (sizes[-1] / sizes[0])
    figures: dict[str, object] = {
        "benchmark": "reconcile",
        "machine": machine(),
        "sizes": results,
        "kafka": kafka,
        # 1.0 is linear; below 1 the fixed costs still weigh, above 1 it grows faster than N.
        "growth_vs_linear": round(growth, 2),
    }
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
