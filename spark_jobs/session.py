"""Building the SparkSession the jobs run in, on any master.

The job needs two jars beside Spark's own: the Kafka source and the PostgreSQL JDBC driver.
Whatever master it runs on, the driver and every executor must have them, so they go to
``spark.jars`` (local paths; Spark serves them to executors from the driver) or to
``spark.jars.packages`` (Maven coordinates that Spark resolves itself, see
:data:`outbox.spark_jobs.jars.SPARK_PACKAGES`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from pyspark.sql import SparkSession

LOGGING_CONF = Path(__file__).with_name("log4j2.properties")


def build_session(
    app_name: str,
    *,
    master: str | None = "local[2]",
    jars: Sequence[str] = (),
    packages: Sequence[str] = (),
    shuffle_partitions: int = 8,
    extra_conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A SparkSession with the given jars (local paths) and packages (Maven coordinates).

    ``master=None`` leaves the master to ``spark-submit``. A local master keeps the driver on
    loopback with its web UI off. ``extra_conf`` comes last, so it overrides all of this.
    """
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master).config(
            # The driver runs here: its log to warnings, as in local mode.
            "spark.driver.extraJavaOptions",
            f"-Dlog4j2.configurationFile={LOGGING_CONF}",
        )
        if master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            builder = (
                builder.config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.ui.enabled", "false")
            )
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    if packages:
        builder = builder.config("spark.jars.packages", ",".join(packages))
    builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions)).config(
        "spark.sql.session.timeZone", "UTC"
    )
    for key, value in (extra_conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
