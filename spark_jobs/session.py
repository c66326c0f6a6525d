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

from outbox.spark_jobs.gateway import launch_resolving_packages

LOGGING_CONF = Path(__file__).with_name("log4j2.properties")


def session_options(
    app_name: str,
    *,
    master: str | None = "local[2]",
    jars: Sequence[str] = (),
    packages: Sequence[str] = (),
    shuffle_partitions: int = 8,
    extra_conf: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The Spark settings of :func:`build_session`, in the order they apply."""
    options = {"spark.app.name": app_name}
    if master:
        options["spark.master"] = master
        # The driver runs here: its log to warnings, as in local mode.
        options["spark.driver.extraJavaOptions"] = f"-Dlog4j2.configurationFile={LOGGING_CONF}"
        if master.startswith("local"):
            options["spark.driver.host"] = "127.0.0.1"
            options["spark.driver.bindAddress"] = "127.0.0.1"
            options["spark.ui.enabled"] = "false"
    if jars:
        options["spark.jars"] = ",".join(jars)
    if packages:
        options["spark.jars.packages"] = ",".join(packages)
    options["spark.sql.shuffle.partitions"] = str(shuffle_partitions)
    options["spark.sql.session.timeZone"] = "UTC"
    options.update(extra_conf or {})
    return options


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

    When packages are to be resolved, the JVM is started here with its output held back, so
    that an Ivy failure raises :class:`~outbox.spark_jobs.gateway.PackagesUnresolved` naming
    Ivy's cause instead of printing its report.
    """
    options = session_options(
        app_name,
        master=master,
        jars=jars,
        packages=packages,
        shuffle_partitions=shuffle_partitions,
        extra_conf=extra_conf,
    )
    if master and master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    if "spark.jars.packages" in options:
        launch_resolving_packages(options)
    builder = SparkSession.builder
    for key, value in options.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
