"""The local Spark is real: DataFrames read from Kafka (Kafka source) and PostgreSQL (JDBC)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer

from outbox.spark_jobs.jdbc import jdbc_options

pytestmark = pytest.mark.integration


def test_spark_reads_a_kafka_topic_in_batch_read_committed(
    spark, bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("spark", partitions=2)
    producer = Producer({"bootstrap.servers": bootstrap_servers, "transactional.id": topic})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(10):
        producer.produce(
            topic,
            key=f"k{i % 3}".encode(),
            value=f"v{i}".encode(),
            headers=[("outbox-id", f"id-{i}".encode())],
        )
    producer.commit_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, key=b"k0", value=b"aborted")
    producer.flush(30)
    producer.abort_transaction(30)

    frame = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap_servers)
        .option("subscribe", topic)
        .option("kafka.isolation.level", "read_committed")
        .option("includeHeaders", "true")
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .load()
    )
    rows = frame.selectExpr(
        "CAST(value AS STRING) AS value", "partition", "headers[0].value AS id"
    ).collect()
    assert sorted(row.value for row in rows) == sorted(f"v{i}" for i in range(10))
    assert {row.partition for row in rows} <= {0, 1}
    assert sorted(bytes(row.id).decode() for row in rows) == sorted(f"id-{i}" for i in range(10))


def test_spark_reads_a_postgres_table_over_jdbc(spark, database_url: str) -> None:  # type: ignore[no-untyped-def]
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (id bigint PRIMARY KEY, total numeric(10,2))"))
        conn.execute(
            sa.text("INSERT INTO orders SELECT g, g * 1.5 FROM generate_series(1, 1000) g")
        )
    engine.dispose()

    frame = (
        spark.read.format("jdbc")
        .options(**jdbc_options(database_url))
        .option("dbtable", "orders")
        .option("partitionColumn", "id")
        .option("lowerBound", "1")
        .option("upperBound", "1000")
        .option("numPartitions", "4")
        .load()
    )
    assert frame.rdd.getNumPartitions() == 4
    summary = frame.agg({"id": "count", "total": "sum"}).collect()[0]
    assert summary["count(id)"] == 1000
    assert float(summary["sum(total)"]) == pytest.approx(1.5 * 1000 * 1001 / 2)
