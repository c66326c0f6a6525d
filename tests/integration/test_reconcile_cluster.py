"""The reconciliation job on a real Spark standalone cluster (a master and two workers started
from PySpark's own `spark-class`, on 127.0.0.1): through `outbox reconcile --master spark://...`
and through `spark-submit --master spark://...`, it finds exactly the injected faults, as local
mode does in test_reconcile (the same faults, the same expectation)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyspark
import pytest

from outbox.devstack.procs import StackError, free_port, port_open, terminate, wait_until
from outbox.devstack.stack import spark_jars
from tests.conftest import server_unavailable
from tests.integration.test_reconcile import inject_faults, relay_until_sent
from tests.relay_helpers import publish_orders

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SPARK_HOME = Path(pyspark.__file__).resolve().parent
#: What the driver and the executors need to run here: loopback, this interpreter, small JVMs.
CLUSTER_CONF = (
    "spark.driver.host=127.0.0.1",
    "spark.executor.memory=512m",
    "spark.cores.max=2",
)


def spark_env(work: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOCAL_DIRS": str(work / "local"),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }


def master_state(ui_port: int) -> dict[str, Any]:
    """The master's own account (its web UI's JSON): workers, running and completed apps."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as reply:
            return json.load(reply)  # type: ignore[no-any-return]
    except OSError:
        return {"workers": [], "completedapps": []}


@dataclass(frozen=True)
class SparkCluster:
    master: str
    ui_port: int


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """A standalone master and two one-core workers; every process stopped afterwards."""
    work = tmp_path_factory.mktemp("spark-cluster")
    env = spark_env(work)
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> None:
        with (work / f"{name}.log").open("wb") as log:
            started.append(
                subprocess.Popen(
                    [str(SPARK_HOME / "bin" / "spark-class"), *args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own group: the teardown stops its children too
                )
            )

    port, ui_port = free_port(), free_port()
    master = f"spark://127.0.0.1:{port}"
    try:
        try:
            start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                  "--port", str(port), "--webui-port", str(ui_port))  # fmt: skip
            wait_until(lambda: port_open(port), 90, "the Spark master")
            for i in range(2):
                start(f"worker-{i}", "org.apache.spark.deploy.worker.Worker", "--host",
                      "127.0.0.1", "--port", str(free_port()), "--webui-port", str(free_port()),
                      "--cores", "1", "--memory", "1g", "--work-dir", str(work / f"worker-{i}"),
                      master)  # fmt: skip
            wait_until(lambda: len(master_state(ui_port)["workers"]) == 2, 90, "two workers")
        except (OSError, StackError) as exc:
            logs = "".join(p.read_text()[-1500:] for p in sorted(work.glob("*.log")))
            server_unavailable("a Spark standalone cluster", RuntimeError(f"{exc}\n{logs}"))
        yield SparkCluster(master, ui_port)
    finally:  # also when starting failed half-way, or the test did
        for process in reversed(started):
            terminate(process.pid, grace=15)
            process.wait(5)


def job_args(outbox_url: str, bootstrap: str, window: tuple[str, str], output: Path) -> list[str]:
    return [
        "--database-url", outbox_url, "--bootstrap-servers", bootstrap,
        "--start", window[0], "--end", window[1], "--grace", "1m",
        "--output", str(output), "--jdbc-slices", "2", "--json",
    ]  # fmt: skip


def summary_of(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 1, result.stderr[-4000:]  # the injected faults are found
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def outbox_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def comparable(summary: dict[str, Any], base: Path) -> dict[str, Any]:
    """What must not depend on where the job ran: the summary without times and paths, and
    the discrepant ids of every class (read back with `outbox reconcile show`)."""
    shown = outbox_cli("reconcile", "show", summary["run_dir"], "--output", str(base),
                       "--limit", "0", "--json")  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    discrepancies = json.loads(shown.stdout)["discrepancies"]
    # records_read_until is the run's start (reads never go past it).
    varying = {
        "run_id",
        "run_dir",
        "started_at",
        "seconds",
        "output",
        "clock_seconds",
        "records_read_until",
    }
    return {
        "summary": {k: v for k, v in summary.items() if k not in varying},
        "ids": {
            cls: sorted(row["message_id"] for row in rows) for cls, rows in discrepancies.items()
        },
    }


# Two Spark applications and a cluster on two cores beside the other test workers.
@pytest.mark.timeout(900)
def test_the_job_finds_the_injected_faults_on_a_standalone_cluster(
    spark_cluster, outbox_url, engine, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("cluster", partitions=3)
    publish_orders(engine, topic, 120, keys=12)
    relay_until_sent(outbox_url, bootstrap_servers, engine, 120)
    injected = inject_faults(engine, bootstrap_servers, topic)
    now = datetime.now(UTC)
    window = ((now - timedelta(minutes=30)).isoformat(), (now + timedelta(minutes=5)).isoformat())
    env = spark_env(tmp_path)
    conf = [arg for setting in CLUSTER_CONF for arg in ("--conf", setting)]
    jars = ",".join(str(jar) for jar in spark_jars())

    def audit(base: str, *spark_args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        args = job_args(outbox_url, bootstrap_servers, window, tmp_path / base)
        summary = summary_of(outbox_cli("reconcile", *args, *spark_args, env=env))
        return comparable(summary, tmp_path / base)

    # The CLI as the driver; the stack's jars go to the workers' executors.
    expected = audit("cli", "--master", spark_cluster.master, *conf, env=env)
    found = {cls: ids for cls, ids in expected["ids"].items() if ids}
    assert found == {cls: sorted(ids) for cls, ids in injected.items()}, expected
    counts = expected["summary"]["discrepancies"]
    assert {cls: n for cls, n in counts.items() if n} == {c: len(i) for c, i in injected.items()}
    # 120 published and the stuck one; 120 records - 3 deleted + a duplicate + a phantom.
    assert (expected["summary"]["outbox_rows"], expected["summary"]["topic_records"]) == (121, 119)

    # spark-submit runs the job's file, the jars passed as a cluster's user would.
    job_file = importlib.util.find_spec("outbox.spark_jobs.reconcile").origin  # type: ignore[union-attr]
    assert job_file is not None
    submit = [str(SPARK_HOME / "bin" / "spark-submit"), "--master", spark_cluster.master]
    submit += ["--jars", jars]
    args = job_args(outbox_url, bootstrap_servers, window, tmp_path / "submit")
    submitted = subprocess.run(
        [*submit, *conf, job_file, *args], capture_output=True, text=True, timeout=600, env=env
    )
    assert comparable(summary_of(submitted), tmp_path / "submit") == expected
    # Both ran as applications of the cluster, on its workers' executors.
    apps = master_state(spark_cluster.ui_port)["completedapps"]
    assert [app["name"] for app in apps] == ["outbox-reconcile"] * 2
    assert all(app["cores"] >= 1 for app in apps), apps
