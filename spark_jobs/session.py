"""Building the SparkSession the jobs run in."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from pyspark.sql import SparkSession


def build_session(
    app_name: str,
    *,
    master: str | None = "local[2]",
    jars: Sequence[str] = (),
    shuffle_partitions: int = 8,
    extra_conf: dict[str, str] | None = None,
) -> SparkSession:
    """A SparkSession with the Kafka source and JDBC driver jars on its classpath.

    ``master=None`` leaves the master to ``spark-submit``; ``jars`` are local paths (the stack
    resolves them from Maven Central once, so runs need no network).
    """
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
        if master.startswith("local"):
            # Keep a local driver on loopback, its web UI off and its log to warnings.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            logging_conf = Path(__file__).with_name("log4j2.properties")
            builder = (
                builder.config(
                    "spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={logging_conf}"
                )
                .config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.ui.enabled", "false")
            )
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions)).config(
        "spark.sql.session.timeZone", "UTC"
    )
    for key, value in (extra_conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
