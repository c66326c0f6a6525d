"""The partitioned layout on the real PostgreSQL: the migration makes it, ids and idempotency
keys stay unique across partitions, and retention drops whole partitions holding only done
rows while the rows not done yet stay (kept, or carried with their ids and order)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox import Outbox, migrate
from outbox.cli import main
from outbox.errors import OutboxError
from outbox.partition_layout import (
    SCHEDULED_INDEX_DEFINITION,
    build_index_concurrently,
    create_range,
    list_partitions,
    period_start,
)
from outbox.partition_retention import maintain
from outbox.schema import DEFAULT_SPEC

pytestmark = pytest.mark.integration

NOW = datetime.now(UTC)
DAY = timedelta(days=1)


def uuid7_at(moment: datetime) -> uuid.UUID:
    millis = int(moment.timestamp() * 1000)
    return uuid.UUID(int=(millis << 80) | (0x7 << 76) | (0b10 << 62) | uuid.uuid4().int >> 66)


@pytest.fixture
def url(database_url: str) -> str:
    migrate.upgrade(database_url, partitioned="daily")
    return database_url


@pytest.fixture
def engine(url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(url)
    yield engine
    engine.dispose()


def add_day(engine: sa.Engine, day: datetime) -> str:
    with engine.begin() as conn:
        return create_range(conn, DEFAULT_SPEC, period_start(day, "daily"), "daily")


def insert(
    engine: sa.Engine,
    made: datetime,
    status: str,
    *,
    key: str | None = None,
    sent: datetime | None = None,
    message_key: bytes | None = None,
) -> uuid.UUID:
    row_id = uuid7_at(made)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox (id, shard, topic, key, value, status, idempotency_key, "
                "created_at, sent_at, prepared_at, check_group, deliver_at, resolved_at) "
                "VALUES (:id, 0, 'orders', :mk, 'x', :status, :key, :made, :sent, "
                "CASE WHEN :status = 'prepared' THEN :made END, "
                "CASE WHEN :status = 'prepared' THEN 'g' END, "
                "CASE WHEN :status IN ('scheduled', 'cancelled') THEN now() + interval '1 day' "
                "END, CASE WHEN :status IN ('rolled_back', 'cancelled') THEN :made END)"
            ),
            {
                "id": row_id,
                "status": status,
                "key": key,
                "made": made,
                "sent": sent,
                "mk": message_key,
            },
        )
    return row_id


def partition_of(engine: sa.Engine, row_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                sa.text("SELECT tableoid::regclass::text FROM outbox WHERE id = :id"),
                {"id": row_id},
            ).scalar_one()
        )


def names(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [p.name for p in list_partitions(conn, DEFAULT_SPEC)]


def test_the_migration_makes_daily_partitions_ahead_and_a_default(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        parts = list_partitions(conn, DEFAULT_SPEC)
    today = period_start(NOW, "daily")
    starts = [p.start for p in parts if p.start is not None]
    assert starts == [today + DAY * n for n in range(8)]
    assert parts[-1].is_default
    # What the API writes lands in today's partition.
    with Outbox(engine).transaction() as tx:
        result = tx.publish("orders", {"n": 1})
    assert partition_of(engine, result.message_id) == f"outbox_p{today:%Y%m%d}"


def scheduled_index_state(conn: sa.Connection) -> tuple[bool, list[str]]:
    """Whether the scheduled index is valid, and the partitions without their part of it."""
    valid = conn.execute(
        sa.text(
            "SELECT x.indisvalid FROM pg_index AS x "
            "WHERE x.indexrelid = to_regclass('outbox_scheduled_idx')"
        )
    ).scalar_one()
    unindexed = conn.execute(
        sa.text(
            "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'outbox'::regclass AND NOT EXISTS ("
            " SELECT 1 FROM pg_inherits AS j JOIN pg_index AS x ON x.indexrelid = j.inhrelid"
            " WHERE j.inhparent = 'outbox_scheduled_idx'::regclass AND x.indrelid = c.oid)"
        )
    ).scalars()
    return bool(valid), list(unindexed)


def test_the_scheduled_index_covers_every_partition_and_the_relay_reads_through_it(
    engine: sa.Engine,
) -> None:
    # Revision 0010 ran on the partitioned table (0009): built partition by partition.
    add_day(engine, NOW - 10 * DAY)  # a partition made after it gets the index too
    with engine.connect() as conn:
        kind = conn.execute(
            sa.text("SELECT relkind FROM pg_class WHERE relname = :n"),
            {"n": "outbox_scheduled_idx"},
        )
        assert kind.scalar_one() == "I"  # a partitioned index
        assert scheduled_index_state(conn) == (True, [])  # valid: every partition's attached
    with Outbox(engine).transaction() as tx:
        later = tx.publish("orders", {"n": 1}, key="k", deliver_after=3600).message_id
    with engine.connect() as conn:
        status = conn.execute(sa.text("SELECT status FROM outbox WHERE id = :id"), {"id": later})
        assert status.scalar_one() == "scheduled"
        conn.execute(sa.text("SET enable_seqscan = off"))  # a few rows: only whether it can
        plan = conn.execute(
            sa.text(
                "EXPLAIN SELECT id FROM outbox WHERE status = 'scheduled' AND shard = 0 "
                "AND deliver_at <= now() ORDER BY deliver_at, seq LIMIT 10"
            )
        ).scalars()
        assert "scheduled_idx" in "\n".join(plan)


def test_revision_0010_on_a_partitioned_table_made_by_maintenance_too(database_url: str) -> None:
    migrate.upgrade(database_url, revision="0009_partitioned_layout", partitioned="daily")
    engine = sa.create_engine(database_url)
    try:
        made = add_day(engine, NOW - 3 * DAY)  # as maintenance makes one: LIKE, then ATTACH
        migrate.upgrade(database_url)
        waiting = insert(engine, NOW - 3 * DAY, "scheduled")  # the new status is accepted
        assert partition_of(engine, waiting) == made
        with engine.connect() as conn:
            assert scheduled_index_state(conn) == (True, [])
        # Interrupted after one partition's index was built, before it was attached: run
        # again, the build finishes the job.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("DROP INDEX outbox_scheduled_idx"))
            conn.execute(
                sa.text(
                    f'CREATE INDEX "{made}_scheduled_idx" ON "{made}" {SCHEDULED_INDEX_DEFINITION}'
                )
            )
            build_index_concurrently(
                conn, DEFAULT_SPEC, "scheduled_idx", SCHEDULED_INDEX_DEFINITION
            )
            assert scheduled_index_state(conn) == (True, [])
        with pytest.raises(Exception, match="holds messages not yet due"):
            migrate.downgrade(database_url, revision="0009_partitioned_layout")
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE outbox SET status = 'sent', sent_at = now()"))
        migrate.downgrade(database_url, revision="0009_partitioned_layout")
        with engine.connect() as conn:
            kind = conn.execute(sa.text("SELECT relkind FROM pg_class WHERE relname = 'outbox'"))
            assert kind.scalar_one() == "p"
            column = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_attribute WHERE attrelid = 'outbox'::regclass "
                    "AND attname = 'deliver_at' AND NOT attisdropped"
                )
            )
            assert column.scalar_one() == 0
        migrate.upgrade(database_url)  # and up again
    finally:
        engine.dispose()


def test_idempotency_keys_stay_unique_across_partitions(engine: sa.Engine) -> None:
    add_day(engine, NOW - 3 * DAY)
    old = insert(engine, NOW - 3 * DAY, "pending", key="order-7")
    assert partition_of(engine, old).endswith(f"{NOW - 3 * DAY:%Y%m%d}")
    with Outbox(engine).transaction() as tx:
        again = tx.publish("orders", {"n": 2}, idempotency_key="order-7")
    assert again.duplicate and again.message_id == old
    # A writer that bypasses the lookup meets the same constraint the plain layout has.
    with pytest.raises(sa.exc.IntegrityError) as raised:
        insert(engine, NOW, "pending", key="order-7")
    assert raised.value.orig.diag.constraint_name == "outbox_idempotency_key_idx"  # type: ignore[union-attr]


def test_a_second_writer_of_a_key_waits_for_the_first_and_then_fails(engine: sa.Engine) -> None:
    first = engine.connect()
    first.begin()
    first.execute(
        sa.text(
            "INSERT INTO outbox (id, shard, topic, status, idempotency_key) "
            "VALUES (:id, 0, 'orders', 'pending', 'k')"
        ),
        {"id": uuid7_at(NOW)},
    )
    outcome: list[BaseException | None] = []

    def second() -> None:
        try:
            insert(engine, NOW + DAY, "pending", key="k")
            outcome.append(None)
        except sa.exc.IntegrityError as error:
            outcome.append(error)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive()  # waiting on the first writer's key
    first.commit()
    first.close()
    thread.join(10)
    assert isinstance(outcome[0], sa.exc.IntegrityError)


def test_retention_drops_done_partitions_and_keeps_one_with_a_pending_row(
    engine: sa.Engine,
) -> None:
    done, busy = NOW - 10 * DAY, NOW - 9 * DAY
    done_name, busy_name = add_day(engine, done), add_day(engine, busy)
    waiting = NOW - 8 * DAY
    waiting_name = add_day(engine, waiting)
    insert(engine, done, "sent", sent=done, key="gone")
    insert(engine, done, "rolled_back", sent=None)
    insert(engine, done, "cancelled", sent=None)  # a cancelled scheduled message is done
    insert(engine, busy, "sent", sent=busy)
    pending = insert(engine, busy, "pending")
    insert(engine, waiting, "sent", sent=waiting)
    scheduled = insert(engine, waiting, "scheduled")  # waits for its time: not done
    report = maintain(engine, timedelta(days=7))
    assert report.dropped == [done_name]
    assert busy_name in report.kept and waiting_name in report.kept
    assert done_name not in names(engine) and busy_name in names(engine)
    assert partition_of(engine, pending) == busy_name
    assert partition_of(engine, scheduled) == waiting_name
    # The dropped rows' idempotency key is given up, as a purge gives it up.
    with Outbox(engine).transaction() as tx:
        assert not tx.publish("orders", {}, idempotency_key="gone").duplicate


def test_carry_moves_rows_not_done_with_their_ids_and_order(engine: sa.Engine) -> None:
    old = NOW - 10 * DAY
    old_name = add_day(engine, old)
    insert(engine, old, "sent", sent=old)
    rows = [
        insert(engine, old, "pending", message_key=b"k", key="p1"),
        insert(engine, old, "dead", message_key=b"k"),
        insert(engine, old, "prepared", key="p2"),
        insert(engine, old, "scheduled", message_key=b"k"),
        insert(engine, old, "sent", sent=NOW - DAY),  # sent after the cut-off: not done
    ]
    later = insert(engine, NOW, "pending", message_key=b"k")
    with engine.connect() as conn:
        before = conn.execute(sa.text("SELECT id, seq, status FROM outbox ORDER BY seq")).all()
    report = maintain(engine, timedelta(days=7), carry=True)
    assert report.dropped == [old_name]
    assert report.carried == {old_name: 5}
    with engine.connect() as conn:
        after = conn.execute(sa.text("SELECT id, seq, status FROM outbox ORDER BY seq")).all()
    assert after == [row for row in before if row.id in {*rows, later}]
    assert {partition_of(engine, r) for r in rows} == {"outbox_default"}
    # The carried rows keep their idempotency keys.
    with Outbox(engine).transaction() as tx:
        assert tx.publish("orders", {}, idempotency_key="p1").duplicate
    # Once done, a later run deletes the carried rows row by row.
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET status = 'sent', sent_at = :at WHERE id = :id"),
            {"at": NOW - 8 * DAY, "id": rows[0]},
        )
    assert maintain(engine, timedelta(days=7)).purged == 1


def test_a_partition_is_made_for_rows_the_default_partition_took(engine: sa.Engine) -> None:
    far = NOW + 30 * DAY
    row = insert(engine, far, "pending", key="skewed")
    assert partition_of(engine, row) == "outbox_default"
    report = maintain(engine, timedelta(days=7), ahead=31)
    assert f"outbox_p{far:%Y%m%d}" in report.created
    assert partition_of(engine, row) == f"outbox_p{far:%Y%m%d}"
    with Outbox(engine).transaction() as tx:
        assert tx.publish("orders", {}, idempotency_key="skewed").duplicate


def test_retention_waits_a_bounded_time_for_the_table_lock(engine: sa.Engine) -> None:
    add_day(engine, NOW - 10 * DAY)
    reader = engine.connect()
    reader.begin()
    reader.execute(sa.text("SELECT count(*) FROM outbox"))  # holds its lock until the end
    try:
        with pytest.raises(OutboxError, match="stayed locked"):
            maintain(engine, timedelta(days=7), lock_timeout=timedelta(milliseconds=50), attempts=2)
    finally:
        reader.rollback()
        reader.close()
    assert maintain(engine, timedelta(days=7)).dropped


def test_downgrade_gives_a_plain_table_with_the_rows(url: str, engine: sa.Engine) -> None:
    with Outbox(engine).transaction() as tx:
        first = tx.publish("orders", {}, idempotency_key="a")
    migrate.downgrade(url, revision="0007_check_failures")
    with engine.connect() as conn:
        assert (
            conn.execute(sa.text("SELECT relkind FROM pg_class WHERE relname = 'outbox'")).scalar()
            == "r"
        )
    with Outbox(engine).transaction() as tx:
        assert tx.publish("orders", {}, idempotency_key="a").message_id == first.message_id
        tx.publish("orders", {})
    with engine.connect() as conn:
        seqs = conn.execute(sa.text("SELECT seq FROM outbox ORDER BY seq")).scalars().all()
    assert len(seqs) == 2 and seqs[0] < seqs[1]


def test_the_command_refuses_to_reach_into_the_audit_window(url: str) -> None:
    runner = CliRunner()
    refused = runner.invoke(
        main, ["partitions", "maintain", "--database-url", url, "--older-than", "1h"]
    )
    assert refused.exit_code == 2 and "refusing" in refused.output
    dry = runner.invoke(
        main, ["partitions", "maintain", "--database-url", url, "--older-than", "7d", "--dry-run"]
    )
    assert dry.exit_code == 0, dry.output
    assert "dry run, nothing changed" in dry.output
    listed = runner.invoke(main, ["partitions", "list", "--database-url", url])
    assert listed.exit_code == 0 and "outbox_default" in listed.output


def test_status_estimates_the_sent_rows_from_the_partitions_statistics(
    url: str, engine: sa.Engine
) -> None:
    for n in range(300):
        insert(engine, NOW, "sent" if n % 3 else "dead", sent=NOW)
    with engine.begin() as conn:  # what autovacuum does: it analyzes partitions, not parents
        conn.execute(sa.text(f"ANALYZE outbox_p{NOW:%Y%m%d}"))
    shown = CliRunner().invoke(main, ["status", "--database-url", url])
    assert shown.exit_code == 0, shown.output
    assert "sent ~200" in shown.output and "dead ~100" in shown.output
