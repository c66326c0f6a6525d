"""Reconciliation runs on the real stack keep their evidence: each run its own directory, the
discrepant ids readable with ``outbox reconcile show`` (without PySpark), and a topic whose rows
were all purged still audited."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.retention import purge_sent
from tests.integration.test_reconcile import relay_until_sent
from tests.relay_helpers import publish_orders

pytestmark = pytest.mark.integration

# `outbox reconcile show` and `list` as a user without PySpark runs them: importing it fails.
WITHOUT_PYSPARK = (
    "import sys; sys.modules['pyspark'] = None; sys.modules['py4j'] = None; "
    "from outbox.cli import main; main()"
)


def outbox_cli(*args: str, spark: bool = True) -> subprocess.CompletedProcess[str]:
    command = (
        [sys.executable, "-m", "outbox.cli"] if spark else [sys.executable, "-c", WITHOUT_PYSPARK]
    )
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=300, check=False
    )


def audit(outbox_url: str, bootstrap: str, base: Path, *window: str) -> tuple[int, dict, str]:  # type: ignore[type-arg]
    result = outbox_cli(
        "reconcile", "--database-url", outbox_url, "--bootstrap-servers", bootstrap,
        *window, "--grace", "1m", "--output", str(base), "--master", "local[2]",
        "--driver-memory", "1g", "--jdbc-slices", "2", "--json",
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr[-3000:]
    return result.returncode, json.loads(result.stdout.strip().splitlines()[-1]), result.stdout


def not_near_midnight() -> None:
    """`--date today` twice must name the same day: wait out the last minutes of a UTC day."""
    now = datetime.now(UTC)
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC)
    if midnight - now < timedelta(minutes=3):
        time.sleep((midnight - now).total_seconds() + 1)


def test_runs_keep_their_evidence_show_their_ids_and_remember_purged_topics(
    outbox_url, engine, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("runs", partitions=2)
    ids = {str(i) for i in publish_orders(engine, topic, 20, keys=4)}
    relay_until_sent(outbox_url, bootstrap_servers, engine, 20)
    base = tmp_path / "audits"
    not_near_midnight()

    code, first, report = audit(outbox_url, bootstrap_servers, base, "--date", "today")
    assert code == 0 and first["verdict"] == "pass" and first["outbox_rows"] == 20
    # Today's window ends at midnight tonight; the topics are read up to the run's start only.
    read_until = datetime.fromisoformat(first["records_read_until"])
    assert read_until == datetime.fromisoformat(first["started_at"])
    assert f"records read until {first['records_read_until']}" in report
    assert first["topics"] == [topic] and first["topics_without_rows"] == []
    today = f"{datetime.now(UTC):%Y-%m-%d}"
    assert first["run_id"].startswith(f"{today}/") and first["run_dir"] == str(
        base / first["run_id"]
    )
    assert f"run directory  {first['run_dir']}" in report

    # Every row of the topic purged too early: its records are now phantoms, and the topic has
    # no row left in the window. The next run still reads it, because the first one did.
    with engine.connect() as conn:
        sent_at = conn.execute(sa.text("SELECT max(sent_at) FROM outbox")).scalar_one()
    assert purge_sent(engine, timedelta(0), now=sent_at + timedelta(seconds=1)) == 20
    code, second, _ = audit(outbox_url, bootstrap_servers, base, "--date", "today")
    assert code == 1 and second["discrepancies"]["phantom"] == 20 and second["outbox_rows"] == 0
    assert second["topics"] == [topic] and second["topics_without_rows"] == [topic]
    assert "earlier runs" in second["topic_scope"]

    # Two runs of the same day: two directories, the first run's evidence intact.
    runs = sorted(p.parent.name for p in (base / today).glob("*/summary.json"))
    assert len(runs) == 2 and second["run_id"] != first["run_id"]
    kept = json.loads((base / first["run_id"] / "summary.json").read_text())
    assert kept["verdict"] == "pass" and kept["run_id"] == first["run_id"]
    assert (base / second["run_id"] / "discrepancies").is_dir()

    # The ids, without writing code and without PySpark.
    shown = outbox_cli(
        "reconcile", "show", second["run_id"], "--output", str(base), "--class", "phantom",
        "--limit", "0", "--json", spark=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    body = json.loads(shown.stdout)
    assert body["counts"]["phantom"] == 20
    assert {row["message_id"] for row in body["discrepancies"]["phantom"]} == ids
    assert {row["topic"] for row in body["discrepancies"]["phantom"]} == {topic}
    text = outbox_cli("reconcile", "show", second["run_dir"], "--limit", "3", spark=False)
    assert text.returncode == 0, text.stderr
    first_id = min(ids)
    assert "phantom: 20\n" in text.stdout and f"  {first_id}  {topic}  " in text.stdout
    assert "... 17 more" in text.stdout

    listed = outbox_cli("reconcile", "list", "--output", str(base), spark=False)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:]] == [second["run_id"], first["run_id"]]
    assert "FAIL     phantom 20" in lines[1] and "PASS     0" in lines[2]

    # The last hour, up to now: the same purged topic, audited for the same reason.
    code, recent, _ = audit(outbox_url, bootstrap_servers, base, "--since", "1h", "--end", "now")
    assert code == 1 and recent["discrepancies"]["phantom"] == 20
    assert recent["topics_without_rows"] == [topic]
    window = recent["window"]
    span = datetime.fromisoformat(window["end"]) - datetime.fromisoformat(window["start"])
    assert span == timedelta(hours=1)
    assert not recent["run_id"].startswith(today + "/")  # a span, not a day
