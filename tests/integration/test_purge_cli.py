"""``outbox purge`` by hand: a dry run, a printed count, and a refusal to reach into the days
the nightly reconciliation still reads (unless overridden), on the real PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from outbox import Message, Outbox
from outbox.cli import main

pytestmark = pytest.mark.integration


def uuid7_at(moment: datetime) -> uuid.UUID:
    millis = int(moment.timestamp() * 1000)
    return uuid.UUID(int=(millis << 80) | (0x7 << 76) | (0b10 << 62) | uuid.uuid4().int >> 66)


@pytest.fixture
def rows(engine: sa.Engine) -> sa.Engine:
    """Three rows sent ten days ago, two sent a minute ago, one pending from ten days ago."""
    with Outbox(engine).transaction() as tx:
        tx.publish_many([Message("orders", {"n": i}) for i in range(6)])
    old = datetime.now(UTC) - timedelta(days=10)
    with engine.begin() as conn:
        ids = conn.execute(sa.text("SELECT id FROM outbox ORDER BY seq")).scalars().all()
        for n, row_id in enumerate(ids):
            made = old if n in (0, 1, 2, 5) else None
            conn.execute(
                sa.text(
                    "UPDATE outbox SET id = :new_id, created_at = COALESCE(:made, created_at), "
                    "status = :status, sent_at = CASE WHEN :status = 'sent' "
                    "THEN COALESCE(:made, now() - interval '1 minute') END WHERE id = :id"
                ),
                {
                    "id": row_id,
                    "new_id": uuid7_at(old) if made else row_id,
                    "made": made,
                    "status": "pending" if n == 5 else "sent",
                },
            )
    return engine


def counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        result = conn.execute(sa.text("SELECT status, count(*) FROM outbox GROUP BY status"))
        return {row[0]: row[1] for row in result}


def purge(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["purge", "--database-url", url, *args])


def test_purge_prints_how_many_rows_it_deleted(rows: sa.Engine, outbox_url: str) -> None:
    result = purge(outbox_url, "--older-than", "7d", "--batch-size", "2")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(
        "deleted 3 sent and rolled-back rows older than 7d "
        "(created and sent, or rolled back, before "
    )
    assert counts(rows) == {"sent": 2, "pending": 1}


def test_a_dry_run_counts_and_deletes_nothing(rows: sa.Engine, outbox_url: str) -> None:
    result = purge(outbox_url, "--older-than", "7d", "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("would delete 3 sent and rolled-back rows older than 7d")
    assert "nothing deleted" in result.output
    assert counts(rows) == {"sent": 5, "pending": 1}


@pytest.mark.parametrize("age", ["0s", "12h", "1d"])
def test_a_cutoff_the_nightly_audit_still_reads_is_refused(
    rows: sa.Engine, outbox_url: str, age: str
) -> None:
    result = purge(outbox_url, "--older-than", age)
    assert result.exit_code == 2
    assert result.output.startswith("Error: refusing to purge up to ")
    assert "(the previous UTC day, with 15 minutes of grace)" in result.output
    assert "--ignore-audit-window" in result.output
    assert counts(rows) == {"sent": 5, "pending": 1}  # nothing deleted


def test_a_dry_run_inside_the_audit_window_says_a_real_run_would_be_refused(
    rows: sa.Engine, outbox_url: str
) -> None:
    result = purge(outbox_url, "--older-than", "0s", "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("would delete 5 sent and rolled-back rows older than 0s")
    assert "a real run would be refused: refusing to purge up to" in result.output
    assert counts(rows) == {"sent": 5, "pending": 1}


def test_the_override_purges_inside_the_audit_window(rows: sa.Engine, outbox_url: str) -> None:
    result = purge(outbox_url, "--older-than", "0s", "--ignore-audit-window")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("deleted 5 sent and rolled-back rows older than 0s")
    assert counts(rows) == {"pending": 1}


def test_a_bad_duration_is_refused(outbox_url: str) -> None:
    result = purge(outbox_url, "--older-than", "3 days")
    assert result.exit_code == 2
    assert "not a duration" in result.output


def test_purge_and_dead_show_on_a_table_not_upgraded_say_to_upgrade(database_url: str) -> None:
    from outbox import migrate

    migrate.upgrade(database_url, revision="0003_wake_trigger")
    engine = sa.create_engine(database_url)
    try:
        with Outbox(engine).transaction() as tx:
            message_id = tx.publish("orders", {"n": 1}).message_id
    finally:
        engine.dispose()
    url = ["--database-url", database_url]
    for args in (
        ["purge", "--older-than", "30d", "--ignore-audit-window"],
        ["dead", "show", str(message_id)],
    ):
        result = CliRunner().invoke(main, [*args, *url])
        assert result.exit_code == 2, result.output
        assert "older than this version of outbox" in result.output
        assert "run `outbox db upgrade`" in result.output
