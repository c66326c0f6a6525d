"""The audit as a service that installed the package runs it: `outbox reconcile jars` fetches
Spark's Kafka source and the JDBC driver into the user's cache, once, and a run started in
the service's folder writes only its run directory there (Spark's scratch goes to the cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_reconcile import relay_until_sent
from tests.relay_helpers import publish_orders

pytestmark = pytest.mark.integration


def outbox_command(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", *args],
        capture_output=True, text=True, timeout=300, cwd=cwd, env={**os.environ, **env},
    )  # fmt: skip


def test_reconcile_jars_fetches_the_jobs_jars_into_the_users_cache_once(tmp_path: Path) -> None:
    env = {"OUTBOX_CACHE_DIR": str(tmp_path / "cache")}
    fetched = outbox_command("reconcile", "jars", cwd=tmp_path, env=env)
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    first, listed = fetched.stdout.strip().splitlines()
    assert first.startswith(f"6 jars in {tmp_path / 'cache' / 'spark-jars'}/"), first
    jars = [Path(p) for p in listed.removeprefix("OUTBOX_SPARK_JARS=").split(",")]
    names = {jar.name for jar in jars}
    assert {"spark-sql-kafka-0-10_2.13-4.0.0.jar", "postgresql-42.7.7.jar"} <= names
    assert all(jar.is_file() for jar in jars)
    again = outbox_command("reconcile", "jars", cwd=tmp_path, env={**env, "PATH": "/nonexistent"})
    assert again.returncode == 0, again.stderr  # resolved already: Maven is not asked again
    assert again.stdout == fetched.stdout


def test_a_run_in_the_services_folder_writes_only_its_run_directory_there(
    outbox_url, engine, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("cwd")
    publish_orders(engine, topic, 5, keys=2)
    relay_until_sent(outbox_url, bootstrap_servers, engine, 5)
    service = tmp_path / "service"
    service.mkdir()
    env = {"OUTBOX_CACHE_DIR": str(tmp_path / "cache")}
    audit = outbox_command(
        "reconcile", "--database-url", outbox_url, "--bootstrap-servers", bootstrap_servers,
        "--since", "1h", "--topic", topic, "--output", "audit", "--master", "local[1]",
        "--driver-memory", "1g", "--jdbc-slices", "1", "--json",
        cwd=service, env=env,
    )  # fmt: skip
    assert audit.returncode == 0, audit.stderr[-3000:]
    summary = json.loads(audit.stdout.strip().splitlines()[-1])
    assert set(summary["discrepancies"].values()) == {0}
    assert sorted(p.name for p in service.iterdir()) == ["audit"]  # no artifacts/, nothing else
    (run,) = (service / "audit").glob("*/*")
    assert {"summary.json", "discrepancies", "discrepancies-json"} <= {
        p.name for p in run.iterdir()
    }
