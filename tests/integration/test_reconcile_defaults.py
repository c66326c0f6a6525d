"""The reconciliation's defaults on the real stack: duplicates after at-least-once relaying
pass (counted and shown), after exactly-once they fail; Spark packages that Ivy cannot resolve
are one line naming Ivy's cause and --jars, and ones it can are resolved without a report."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from outbox import ID_HEADER
from outbox.devstack import spark_jars
from tests.integration.test_reconcile import reconcile_cli, records_of, relay_until_sent
from tests.relay_helpers import publish_orders

pytestmark = pytest.mark.integration

POSTGRES_DRIVER = "org.postgresql:postgresql:42.7.7"


def test_duplicates_pass_after_at_least_once_and_fail_after_exactly_once(
    outbox_url, engine, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("dups", partitions=2)
    publish_orders(engine, topic, 20, keys=4)
    relay_until_sent(outbox_url, bootstrap_servers, engine, 20)
    # Two records sent twice, as an at-least-once relay killed before marking them resends.
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    twice = records_of(bootstrap_servers, topic, 2)[:2]
    for record in twice:
        producer.produce(
            topic, record.value(), record.key(), record.partition(), headers=record.headers()
        )
    assert producer.flush(30) == 0
    resent = {dict(r.headers())[ID_HEADER].decode() for r in twice}

    # No progress topic of this name: no exactly-once relay sent from the table.
    absent = f"outbox-progress-absent-{uuid.uuid4().hex[:8]}"
    code, relaxed = reconcile_cli(
        outbox_url, bootstrap_servers, tmp_path / "a", "--topic", topic, "--progress-topic", absent
    )
    assert code == 0, relaxed
    assert relaxed["discrepancies"]["duplicate"] == 2 and relaxed["verdict"] == "pass"
    assert relaxed["limits"]["duplicate"] is None and relaxed["limits"]["missing"] == 0
    assert relaxed["delivery"]["mode"] == "at-least-once"
    assert absent in relaxed["delivery"]["reason"]

    # The progress topic exists: an exactly-once relay sent from the table; limit 0.
    progress = make_topic("progress")
    code, strict = reconcile_cli(
        outbox_url, bootstrap_servers, tmp_path / "b", "--topic", topic,
        "--progress-topic", progress,
    )  # fmt: skip
    assert code == 1, strict
    assert strict["delivery"]["mode"] == "exactly-once"
    assert strict["breaches"] == {"duplicate": {"count": 2, "limit": 0}}
    shown = subprocess.run(
        [sys.executable, "-m", "outbox.cli", "reconcile", "show", strict["run_dir"], "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert '"duplicate"' in shown.stdout and all(i in shown.stdout for i in resent)


def reconcile_with_packages(
    outbox_url: str, bootstrap: str, home: Path, *spark: str
) -> subprocess.CompletedProcess[str]:
    """`outbox reconcile` with Ivy's caches and ~/.m2 under ``home``, not the user's."""
    env = {
        **os.environ,
        "HOME": str(home),
        # The JVM takes ~ from user.home, not HOME.
        "SPARK_SUBMIT_OPTS": f"-Duser.home={home}",
    }
    env.pop("OUTBOX_SPARK_JARS", None)
    env.pop("OUTBOX_SPARK_PACKAGES", None)
    return subprocess.run(
        [
            sys.executable, "-m", "outbox.cli", "reconcile", "--database-url", outbox_url,
            "--bootstrap-servers", bootstrap, "--since", "10m", "--output", str(home / "out"),
            "--master", "local[1]", "--driver-memory", "1g", "--jdbc-slices", "1", *spark,
        ],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


def m2_artifact(home: Path, jar: Path | None) -> None:
    """org.postgresql:postgresql:42.7.7 in ``home``'s ~/.m2: its POM, and the jar if given."""
    folder = home / ".m2" / "repository" / "org" / "postgresql" / "postgresql" / "42.7.7"
    folder.mkdir(parents=True)
    (folder / "postgresql-42.7.7.pom").write_text(
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        "<groupId>org.postgresql</groupId><artifactId>postgresql</artifactId>"
        "<version>42.7.7</version><packaging>jar</packaging></project>\n"
    )
    if jar is not None:
        shutil.copy(jar, folder / "postgresql-42.7.7.jar")


def test_packages_ivy_cannot_resolve_are_one_line_naming_the_cause_and_jars(
    outbox_url, bootstrap_servers, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    # A POM without its jar in ~/.m2, as Maven leaves for dependencies it needed only the
    # POM of: Ivy takes the module from there and fails on the jar, with no network asked.
    m2_artifact(tmp_path, jar=None)
    result = reconcile_with_packages(
        outbox_url, bootstrap_servers, tmp_path, "--packages", POSTGRES_DRIVER
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    jar = tmp_path / ".m2/repository/org/postgresql/postgresql/42.7.7/postgresql-42.7.7.jar"
    assert lines[-1] == (
        f"Error: cannot start Spark: Ivy could not resolve the packages {POSTGRES_DRIVER}: "
        "download failed: org.postgresql#postgresql;42.7.7!postgresql.jar "
        f"(tried file:{jar}); fetch them once with `outbox reconcile jars` (Maven), or give "
        "the jars as local files with --jars PATHS (or OUTBOX_SPARK_JARS)"
    )
    assert "JAVA_GATEWAY_EXITED" not in result.stderr and "::" not in result.stderr
    assert len(lines) <= 3, result.stderr  # the run's first line, the error, nothing of Ivy's


def test_packages_ivy_resolves_start_spark_without_its_report(
    outbox_url, bootstrap_servers, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    jars = {jar.name: jar for jar in spark_jars()}
    m2_artifact(tmp_path, jar=jars.pop("postgresql-42.7.7.jar"))
    kafka_source = ",".join(str(jar) for jar in jars.values())
    result = reconcile_with_packages(
        outbox_url, bootstrap_servers, tmp_path,
        "--packages", POSTGRES_DRIVER, "--jars", kafka_source, "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verdict: PASS" in result.stdout
    assert ":: resolution report ::" not in result.stderr
    assert (tmp_path / ".ivy2.5.2" / "jars" / "org.postgresql_postgresql-42.7.7.jar").exists()
