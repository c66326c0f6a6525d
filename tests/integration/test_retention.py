"""Purging sent rows: only old sent ones (and rolled-back prepared messages), in bounded
batches; how far back the audit reads.

The command line's checks are in test_purge_cli.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.prepared import PreparedMessages
from outbox.retention import AUDIT_GRACE, audit_horizon, purge_sent
from outbox.spark_jobs.window import AuditWindow

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


def test_a_dry_run_counts_what_a_purge_would_delete(engine: sa.Engine) -> None:
    seed(engine, 5)
    set_status(engine, "sent", 3600, 3)
    later = datetime.now(UTC) + timedelta(seconds=5)
    assert purge_sent(engine, timedelta(seconds=1), now=later, dry_run=True) == 3
    assert counts(engine) == {"pending": 2, "sent": 3}
    assert purge_sent(engine, timedelta(seconds=1), now=later) == 3


def test_rolled_back_prepared_messages_go_but_prepared_ones_never(engine: sa.Engine) -> None:
    prepared = PreparedMessages(Outbox(engine))
    for n in range(3):
        prepared.prepare("orders", {"n": n}).rollback()
    for n in range(2):
        prepared.prepare("orders", {"n": n})
    seed(engine, 2)
    set_status(engine, "sent", 3600, 1)
    later = datetime.now(UTC) + timedelta(seconds=5)
    assert purge_sent(engine, timedelta(seconds=1), now=later, dry_run=True) == 4
    assert purge_sent(engine, timedelta(seconds=1), now=later) == 4
    assert counts(engine) == {"prepared": 2, "pending": 1}
    # However old, a message waiting for a verdict stays.
    assert purge_sent(engine, timedelta(0), now=later + timedelta(days=30)) == 0
    assert counts(engine) == {"prepared": 2, "pending": 1}


@pytest.mark.parametrize(
    ("now", "horizon"),
    [
        ("2026-11-23T07:00:00+00:00", "2026-11-21T23:45:00+00:00"),
        ("2026-11-23T00:00:00+00:00", "2026-11-21T23:45:00+00:00"),
        ("2026-11-23T23:59:59+00:00", "2026-11-21T23:45:00+00:00"),
        ("2026-11-23T01:30:00+02:00", "2026-11-20T23:45:00+00:00"),  # 23:30 UTC the day before
    ],
)
def test_the_audit_horizon_is_the_start_of_the_previous_utc_day_less_the_grace(
    now: str, horizon: str
) -> None:
    moment = datetime.fromisoformat(now)
    assert audit_horizon(moment) == datetime.fromisoformat(horizon)
    # The nightly audit's own window: the purge guard must never disagree with it.
    assert audit_horizon(moment) == AuditWindow.yesterday(moment).read_from
    assert AuditWindow.yesterday(moment).grace == AUDIT_GRACE


def test_cancelled_scheduled_messages_go_but_scheduled_ones_never(engine: sa.Engine) -> None:
    from outbox.scheduled import ScheduledMessages

    ob = Outbox(engine)
    with ob.transaction() as tx:
        doomed = tx.publish("orders", 1, deliver_after=3600).message_id
        tx.publish("orders", 2, deliver_after=3600)
    ScheduledMessages(ob).cancel(doomed)
    later = datetime.now(UTC) + timedelta(seconds=5)
    assert purge_sent(engine, timedelta(seconds=1), now=later, dry_run=True) == 1
    assert purge_sent(engine, timedelta(seconds=1), now=later) == 1
    assert counts(engine) == {"scheduled": 1}
    # However old, a message waiting for its time stays.
    assert purge_sent(engine, timedelta(0), now=later + timedelta(days=30)) == 0
    assert counts(engine) == {"scheduled": 1}
