"""Starting the job's Spark session and running the job on it, with one-line errors.

Plain Python until :func:`run_on_spark` runs: PySpark is imported there, so the CLI's other
commands work without it.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import click

from outbox.spark_jobs.jars import SPARK_PACKAGES, cached_jars
from outbox.spark_jobs.window import AuditWindow

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from outbox.spark_jobs.reconcile import ReconcileConfig
    from outbox.spark_jobs.report import RunSummary

#: Exit status when the job could not run (bad option, unreachable service); 1 means "found
#: discrepancies over their limits", 0 "within limits".
EXIT_ERROR = 2

#: The driver's memory in local mode: 1 GB per 12 hours of window, from 1 GB to 4 GB.
MEMORY_PER_GB = timedelta(hours=12)
MIN_DRIVER_GB, MAX_DRIVER_GB = 1, 4


class JobError(click.ClickException):
    exit_code = EXIT_ERROR


def driver_memory_for(window: AuditWindow) -> str:
    """The default ``--driver-memory``: ``1g`` up to 12 hours of window, ``2g`` up to a day
    (the nightly run), ``3g`` up to 36 hours, ``4g`` beyond.

    Local mode runs the executors inside the driver, so this is all the job's memory; the
    join and the aggregation spill to disk past it, so a longer window is slower, not failed.
    """
    halves = math.ceil((window.end - window.start) / MEMORY_PER_GB)
    return f"{min(MAX_DRIVER_GB, max(MIN_DRIVER_GB, halves))}g"


@dataclass(frozen=True)
class SparkSetup:
    """Where and how the job's Spark session runs: the master and what its JVMs need."""

    #: ``local[*]``, ``spark://host:7077``, ``yarn``, ``k8s://...``; None: spark-submit's.
    master: str | None = None
    #: Local mode only; None: sized from the window (:func:`driver_memory_for`).
    driver_memory: str | None = None
    #: Local jar paths and Maven coordinates; with neither, see :func:`default_jars`.
    jars: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    #: Spark settings given with --conf, applied last.
    conf: Mapping[str, str] = field(default_factory=dict)


def default_jars() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(jars, packages) when none are given: the local stack's jars in a source checkout
    (resolved once from Maven Central, so runs need no network); from an installed package,
    the jars ``outbox reconcile jars`` resolved into the user's cache, else the pinned
    packages (which Spark resolves itself, with Ivy, at every start)."""
    if importlib.util.find_spec("outbox.devstack") is None:  # an installed wheel
        cached = cached_jars()
        if cached:
            return tuple(str(jar) for jar in cached), ()
        return (), SPARK_PACKAGES
    from outbox.devstack import StackError, spark_jars

    try:
        return tuple(str(jar) for jar in spark_jars()), ()
    except StackError as exc:  # Maven missing or offline: say so in one line
        raise JobError(f"cannot resolve the local stack's Spark jars: {exc}") from None


def run_on_spark(config: ReconcileConfig, setup: SparkSetup | None = None) -> RunSummary:
    """Run the job on a session made for it and stop it; Spark's own failures become a
    one-line :class:`JobError`.

    Every master gets the jars: under spark-submit they come from its own --jars/--packages
    (the driver's JVM is running by then); otherwise from ``setup`` or :func:`default_jars`.
    """
    from outbox.spark_jobs.reconcile import run

    setup = setup or SparkSetup()
    master = setup.master
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit launched this driver
    if master is None and not under_submit:
        master = "local[*]"
    jars, packages = setup.jars, setup.packages
    if not (jars or packages or under_submit):
        jars, packages = default_jars()
    # The job reports its own progress, line by line; Spark's bar redraws one line.
    conf = {"spark.ui.showConsoleProgress": "false"}
    if master and master.startswith("local"):
        conf["spark.driver.memory"] = setup.driver_memory or driver_memory_for(config.window)
    conf.update(setup.conf)
    spark = start_session(master, jars, packages, conf)
    spark.sparkContext.setLogLevel("WARN")
    try:
        return run(spark, config)
    except Exception as exc:
        from py4j.protocol import Py4JJavaError
        from pyspark.errors import PySparkException

        if isinstance(exc, PySparkException | Py4JJavaError):
            raise JobError(f"the job failed: {_first_line(exc)}") from None
        raise
    finally:
        spark.stop()


def start_session(
    master: str | None,
    jars: tuple[str, ...],
    packages: tuple[str, ...],
    conf: Mapping[str, str],
) -> SparkSession:
    """The job's session; a failure to start it is one :class:`JobError` line."""
    from outbox.spark_jobs.gateway import PackagesUnresolved
    from outbox.spark_jobs.session import build_session

    try:
        return build_session(
            "outbox-reconcile", master=master, jars=jars, packages=packages, extra_conf=conf
        )
    except PackagesUnresolved as exc:
        raise JobError(
            f"cannot start Spark: Ivy could not resolve the packages {','.join(packages)}: "
            f"{exc}; fetch them once with `outbox reconcile jars` (Maven), or give the jars as "
            "local files with --jars PATHS (or OUTBOX_SPARK_JARS)"
        ) from None
    except Exception as exc:  # a missing JVM surfaces as several exception types
        raise JobError(f"cannot start Spark: {str(exc).strip().splitlines()[0]}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("An error occurred", "JVM stacktrace")):
            return line[:500]
    return text[:500]
