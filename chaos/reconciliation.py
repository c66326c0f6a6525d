"""The audit's reconciliation: the project's Spark job over the run's window, strict limits."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path

from outbox.spark_jobs.cli import SparkSetup, run_on_spark
from outbox.spark_jobs.reconcile import ReconcileConfig
from outbox.spark_jobs.report import RunSummary
from outbox.spark_jobs.window import AuditWindow


def reconcile_run(
    database_url: str,
    bootstrap: str,
    topics: Sequence[str],
    start: datetime,
    end: datetime,
    output: Path,
) -> RunSummary:
    """Every message made in ``[start, end)``: rows against records (read_committed).

    ``stuck_after=0``: after the drain, any row not sent (pending or dead) counts as stuck.
    """
    config = ReconcileConfig(
        database_url=database_url,
        window=AuditWindow(start, end, grace=timedelta(minutes=1)),
        output=str(output),
        topics=tuple(topics),
        bootstrap_servers=bootstrap,
        stuck_after=timedelta(0),
        late_after=timedelta(minutes=10),
        jdbc_slices=2,
    )
    return run_on_spark(config, SparkSetup(master="local[2]", driver_memory="1g"))
