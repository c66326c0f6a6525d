"""The jars the job needs beside Spark's own, as Maven coordinates (no PySpark import here).

Spark's Kafka source and the PostgreSQL JDBC driver, pinned to the PySpark in pyproject.toml;
the same versions as devstack/maven/spark/pom.xml, which resolves them for the local stack
(tests/unit/test_reconcile_parts.py keeps the two in step).
"""

SPARK_PACKAGES = (
    "org.apache.spark:spark-sql-kafka-0-10_2.13:4.0.0",
    "org.postgresql:postgresql:42.7.7",
)
