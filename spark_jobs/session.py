"""Building the SparkSession the jobs run in, on any master.

The job needs two jars beside Spark's own: the Kafka source and the PostgreSQL JDBC driver.
Whatever master it runs on, the driver and every executor must have them, so they go to
``spark.jars`` (local paths; Spark serves them to executors from the driver) or to
``spark.jars.packages`` (Maven coordinates that Spark resolves itself, see
:data:`outbox.spark_jobs.jars.SPARK_PACKAGES`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from pyspark.sql import SparkSession

from outbox.spark_jobs.gateway import launch_jvm

LOGGING_CONF = Path(__file__).with_name("log4j2.properties")


def spark_path(path: str) -> str:
    """``path`` as the job hands it to Spark: a local path made absolute (the JVM runs in a
    directory of its own, not in this process's), a URI (``s3a://``, ``file:``...) as it is."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path):
        return path
    return os.path.abspath(path)


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
        options["spark.jars"] = ",".join(spark_path(jar) for jar in jars)
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

    The JVM is started here, in a working directory of outbox's own (see
    :mod:`outbox.spark_jobs.gateway`). When packages are to be resolved, its output is held
    back, so that an Ivy failure raises
    :class:`~outbox.spark_jobs.gateway.PackagesUnresolved` naming Ivy's cause instead of
    printing its report.
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
    launch_jvm(options)
    builder = SparkSession.builder
    for key, value in options.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
