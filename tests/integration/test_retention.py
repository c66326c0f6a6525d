"""Purging sent rows: only old sent ones, in bounded batches, from the API and the CLI."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox import Message, Outbox
from outbox.cli import main
from outbox.retention import purge_sent

pytestmark = pytest.mark.integration


def seed(engine: sa.Engine, count: int) -> None:
    with Outbox(engine).transaction() as tx:
        tx.publish_many([Message("orders", {"n": i}) for i in range(count)])


def set_status(engine: sa.Engine, status: str, sent_ago: float | None, limit: int) -> None:
    """Move the first ``limit`` pending rows to ``status``, sent ``sent_ago`` seconds ago."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = :status, "
                "sent_at = now() - make_interval(secs => CAST(:ago AS float8)) "
                "WHERE id IN (SELECT id FROM outbox WHERE status = 'pending' ORDER BY seq LIMIT :n)"
            ),
            {"status": status, "ago": sent_ago, "n": limit},
        )


def counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        result = conn.execute(sa.text("SELECT status, count(*) FROM outbox GROUP BY status"))
        return {row[0]: row[1] for row in result}


def test_purge_deletes_only_sent_rows_past_the_age_in_batches(engine: sa.Engine) -> None:
    seed(engine, 30)
    set_status(engine, "sent", 3600, 25)
    set_status(engine, "dead", None, 2)
    statements: list[str] = []
    sa.event.listen(
        engine, "before_cursor_execute", lambda c, cur, stmt, *a: statements.append(stmt)
    )
    later = datetime.now(UTC) + timedelta(seconds=5)  # rows were created seconds ago
    deleted = purge_sent(engine, timedelta(seconds=1), batch_size=10, now=later)
    deletes = [s for s in statements if "DELETE" in s]
    assert deleted == 25
    assert len(deletes) == 3  # 10 + 10 + 5: bounded batches, each its own transaction
    assert counts(engine) == {"pending": 3, "dead": 2}


def test_rows_created_or_sent_recently_are_kept(engine: sa.Engine) -> None:
    seed(engine, 4)
    set_status(engine, "sent", 0, 4)
    assert purge_sent(engine, timedelta(hours=1)) == 0
    assert counts(engine) == {"sent": 4}


def test_cli_purge(outbox_url: str, engine: sa.Engine) -> None:
    seed(engine, 3)
    set_status(engine, "sent", 3 * 86400, 3)
    result = CliRunner().invoke(
        main, ["purge", "--database-url", outbox_url, "--older-than", "0s", "--batch-size", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "deleted 3 sent rows" in result.output
    bad = CliRunner().invoke(
        main, ["purge", "--database-url", outbox_url, "--older-than", "3 days"]
    )
    assert bad.exit_code == 2
    assert "not a duration" in bad.output
