"""`outbox relay` and `outbox dead ...` from the command line: clear one-line errors, no
secrets, and the operator's tools for dead messages."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox import Outbox
from outbox.cli import main

pytestmark = pytest.mark.integration


def run_relay(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", "relay", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_unreachable_database_is_one_clear_line_without_the_password(bootstrap_servers) -> None:  # type: ignore[no-untyped-def]
    url = "postgresql+psycopg://relay:top-secret-pw@127.0.0.1:1/shop"
    result = run_relay(
        "--database-url",
        url,
        "--bootstrap-servers",
        bootstrap_servers,
        "--start-timeout",
        "0",
        "--log-format",
        "text",
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: database error:")
    assert "top-secret-pw" not in result.stderr + result.stdout


def test_missing_table_and_bad_settings_are_named(database_url, bootstrap_servers) -> None:  # type: ignore[no-untyped-def]
    missing = run_relay("--database-url", database_url, "--bootstrap-servers", bootstrap_servers)
    assert missing.returncode == 2
    assert "outbox db upgrade" in missing.stderr
    bad = run_relay(
        "--database-url",
        database_url,
        "--bootstrap-servers",
        bootstrap_servers,
        "--batch-size",
        "0",
    )
    assert bad.returncode == 2 and "batch size must be between" in bad.stderr
    bad_x = run_relay(
        "--database-url", database_url, "--bootstrap-servers", bootstrap_servers, "-X", "acks"
    )
    assert bad_x.returncode == 2 and "KEY=VALUE" in bad_x.stderr


def test_dead_messages_can_be_listed_shown_retried_and_purged(outbox_url, engine) -> None:  # type: ignore[no-untyped-def]
    ob = Outbox(engine)
    with ob.transaction() as tx:
        ids = [tx.publish("orders", {"n": n}, key="k").message_id for n in range(3)]
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = 'dead', attempts = 12, "
                "error_kind = 'message_too_large', last_error = 'Broker: Message size too large'"
            )
        )
    cli = CliRunner()
    base = ["--database-url", outbox_url]
    listed = cli.invoke(main, ["dead", "list", *base])
    assert listed.exit_code == 0 and "3 dead message(s)" in listed.output
    assert "message_too_large" in listed.output
    shown = cli.invoke(main, ["dead", "show", *base, str(ids[0])])
    assert shown.exit_code == 0 and '{"n":0}' in shown.output
    missing = cli.invoke(main, ["dead", "show", *base, str(uuid.uuid4())])
    assert missing.exit_code == 2 and "no message" in missing.output
    assert cli.invoke(main, ["dead", "retry", *base]).exit_code == 2  # says which ones
    retried = cli.invoke(main, ["dead", "retry", *base, str(ids[0])])
    assert "requeued 1" in retried.output
    purged = cli.invoke(main, ["dead", "purge", *base, "--all"])
    assert "deleted 2" in purged.output
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, status, attempts FROM outbox")).all()
    assert [(r.id, r.status, r.attempts) for r in rows] == [(ids[0], "pending", 0)]


def test_relay_logs_and_metrics_are_free_of_secrets(
    outbox_url, bootstrap_servers, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    import urllib.request

    from tests.relay_helpers import start_relay_process, stop_process

    log = tmp_path / "relay.log"
    relay = start_relay_process(
        outbox_url, bootstrap_servers, "-X", "sasl.password=hunter2-kafka-secret", log=log
    )
    scraped = ""
    for path in ("metrics", "healthz", "readyz"):
        url = f"http://127.0.0.1:{relay.metrics_port}/{path}"
        scraped += urllib.request.urlopen(url, timeout=5).read().decode()
    assert stop_process(relay) == 0
    text = log.read_text()
    database_password = sa.make_url(outbox_url).password
    assert database_password and database_password not in text
    assert "outbox_relay_" in scraped  # the metrics were really read
    assert database_password not in scraped and "hunter2-kafka-secret" not in scraped
    assert "hunter2-kafka-secret" not in text
    assert "'sasl.password': '***'" in text  # the start-up line shows the setting, masked
    import json

    ours = [line for line in text.splitlines() if line.startswith("{")]
    assert ours and all(json.loads(line)["level"] for line in ours)
