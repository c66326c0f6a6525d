"""Scheduled messages on the real stack: stored with the business rows, invisible to the read
until due, made pending in due order by the relay that owns their shard, sent within a second
of their time by an idle relay that wakes for them, cancelled before that."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from outbox import ImmediateSender, Message, Outbox
from outbox.cli import main
from outbox.devstack.topics import consume_messages
from outbox.errors import InvalidSchedule, NotScheduled
from outbox.prepared import PreparedMessages
from outbox.queries import Queries
from outbox.relay.observability import RelayMetrics
from outbox.relay.promotion import ScheduledPromotion
from outbox.relay.store import HELD_REACH
from outbox.scheduled import ScheduledMessages
from outbox.schema import DEFAULT_SPEC, SHARD_COUNT, OutboxTableSpec
from outbox.status import read_status
from tests.conftest import outbox_conninfo
from tests.relay_helpers import (
    message_id,
    owns_every_shard,
    relay_config,
    running_relay,
    statuses,
    wait_for,
)

pytestmark = pytest.mark.integration


def rows(engine: sa.Engine) -> dict[uuid.UUID, sa.Row]:  # type: ignore[type-arg]
    with engine.connect() as conn:
        found = conn.execute(
            sa.text(
                "SELECT id, seq, status, deliver_at, created_at, sent_at, lease_owner FROM outbox"
            )
        )
        return {row.id: row for row in found}


def test_a_scheduled_message_is_stored_with_the_transaction_and_only_then(engine) -> None:  # type: ignore[no-untyped-def]
    ob = Outbox(engine)
    due = datetime.now(UTC) + timedelta(hours=1)
    with pytest.raises(RuntimeError), ob.transaction() as tx:
        tx.publish("orders", {"n": 1}, key=1, deliver_at=due)
        raise RuntimeError("the business step failed")
    assert rows(engine) == {}
    with ob.transaction() as tx:
        later = tx.publish("orders", {"n": 2}, key=1, deliver_after=timedelta(minutes=5))
        at = tx.publish("orders", {"n": 3}, key=1, deliver_at=due)
        past = tx.publish("orders", {"n": 4}, key=1, deliver_at=datetime.now(UTC) - timedelta(1))
        now = tx.publish("orders", {"n": 5}, key=1, deliver_after=0)
    found = rows(engine)
    assert found[later.message_id].status == "scheduled"
    assert found[at.message_id].deliver_at == due
    # Already due at publish: an ordinary pending message.
    assert (found[past.message_id].status, found[past.message_id].deliver_at) == ("pending", None)
    assert found[now.message_id].status == "pending"


def test_bad_times_are_refused_before_anything_is_written(engine) -> None:  # type: ignore[no-untyped-def]
    ob = Outbox(engine)
    with ob.transaction() as tx:
        tx.publish("orders", {"n": 0})
        for bad in (
            {"deliver_at": datetime.now() + timedelta(hours=1)},  # naive
            {"deliver_after": -1},
            {"deliver_after": 5, "deliver_at": datetime.now(UTC)},
        ):
            with pytest.raises(InvalidSchedule):
                tx.publish("orders", {"n": 1}, **bad)
            with pytest.raises(InvalidSchedule):
                tx.publish_many([Message("orders", 1), Message("orders", 2, **bad)])
    assert list(statuses(engine).items()) == [("pending", 1)]  # the transaction went on


def promote_all(spec: OutboxTableSpec, url: str) -> int:
    with psycopg.connect(outbox_conninfo(url), autocommit=True) as conn:
        promotion = ScheduledPromotion(spec, RelayMetrics())
        return promotion.promote(range(SHARD_COUNT), conn, None)


def test_due_rows_take_new_seqs_in_due_order_and_the_rest_wait(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    ob = Outbox(engine)
    later = datetime.now(UTC) + timedelta(hours=1)
    with ob.transaction() as tx:
        # Written in this order; due (below) in another, with two due at the same moment.
        ids = [
            r.message_id
            for r in tx.publish_many(
                [Message("orders", n, key="k", deliver_at=later) for n in range(6)]
            )
        ]
        plain = tx.publish("orders", "plain", key="k").message_id
    base = datetime.now(UTC) - timedelta(minutes=10)
    due = {ids[0]: base + timedelta(seconds=3), ids[1]: base, ids[2]: base + timedelta(seconds=2)}
    due[ids[3]] = base + timedelta(seconds=1)  # the same moment as ids[4]:
    due[ids[4]] = base + timedelta(seconds=1)  # their seqs decide
    with engine.begin() as conn:
        for mid, at in due.items():
            conn.execute(
                sa.text("UPDATE outbox SET deliver_at = :at WHERE id = :id"), {"at": at, "id": mid}
            )
    ScheduledMessages(ob).cancel(ids[0])
    assert promote_all(ob.spec, outbox_url) == 4
    found = rows(engine)
    promoted = sorted((found[m].seq, m) for m in due if m != ids[0])
    assert [m for _, m in promoted] == [ids[1], ids[3], ids[4], ids[2]]
    assert all(found[m].seq > found[plain].seq for m in due if m != ids[0])
    assert found[ids[0]].status == "cancelled"
    assert found[ids[5]].status == "scheduled"  # not due yet
    assert promote_all(ob.spec, outbox_url) == 0


def test_the_relay_sends_when_due_not_before_and_holds_back_nothing_meanwhile(  # type: ignore[no-untyped-def]
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:
    topic = make_topic("sched")
    ob = Outbox(engine)
    # A poll interval far above the bound asserted below: only waking for the due time can
    # send the message in time.
    config = relay_config(outbox_url, bootstrap_servers, poll_interval=30.0)
    with running_relay(config) as relay:
        wait_for(lambda: owns_every_shard(relay), 30, "the relay to own its shards")
        with ob.transaction() as tx:
            first = tx.publish(topic, "first", key="k").message_id
            scheduled = tx.publish(topic, "scheduled", key="k", deliver_after=2.0).message_id
            after = tx.publish(topic, "after", key="k").message_id
        written_at = datetime.now(UTC)
        wait_for(lambda: statuses(engine).get("sent") == 2, 10, "the others to go at once")
        assert rows(engine)[scheduled].status == "scheduled"
        wait_for(lambda: statuses(engine) == {"sent": 3}, 15, "the scheduled message")
    row = rows(engine)[scheduled]
    late = (row.sent_at - row.deliver_at).total_seconds()
    assert row.deliver_at >= written_at + timedelta(seconds=1.9)
    assert 0 <= late < 3.0, late  # measured about 0.01-0.05 s on an idle machine
    records = consume_messages(bootstrap_servers, topic, expect=3, timeout=30)
    assert [message_id(r) for r in records] == [first, after, scheduled]
    sent = records[2].timestamp()[1] / 1000
    assert sent >= row.deliver_at.timestamp() - 0.001  # produced no earlier than its time


def test_cancel_stops_it_and_says_when_there_was_nothing_to_cancel(engine) -> None:  # type: ignore[no-untyped-def]
    ob = Outbox(engine)
    scheduled = ScheduledMessages(ob)
    with ob.transaction() as tx:
        waiting = tx.publish("orders", 1, deliver_after=3600, idempotency_key="once").message_id
        plain = tx.publish("orders", 2).message_id
    listed = scheduled.list()
    assert [m.message_id for m in listed] == [waiting]
    scheduled.cancel(waiting)
    scheduled.cancel(waiting)  # again: nothing more to do, no error
    assert rows(engine)[waiting].status == "cancelled"
    with pytest.raises(NotScheduled) as refused:
        scheduled.cancel(plain)
    assert refused.value.status == "pending"
    with pytest.raises(NotScheduled):
        scheduled.cancel(uuid.uuid4())
    # The idempotency key was given up: scheduling again writes a new message.
    with ob.transaction() as tx:
        again = tx.publish("orders", 1, deliver_after=3600, idempotency_key="once")
    assert not again.duplicate and again.message_id != waiting
    with ob.transaction() as tx:
        ob_cancel = scheduled.cancel(again.message_id, bind=tx.session)
    assert ob_cancel is None and rows(engine)[again.message_id].status == "cancelled"
    assert scheduled.list() == []


def test_an_idle_relay_sleeps_until_the_next_due_message(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    ob = Outbox(engine)
    with ob.transaction() as tx:
        tx.publish("orders", 1, key="a", deliver_after=5.0)
    promotion = ScheduledPromotion(ob.spec, RelayMetrics(), interval=0.1)
    with psycopg.connect(outbox_conninfo(outbox_url), autocommit=True) as conn:
        assert promotion.promote(range(SHARD_COUNT), conn, None, now=100.0) == 0
        assert 4.0 < promotion.sleep_bound(30.0, now=100.0) <= 5.01
        # A commit woke the relay right after the look: it may have scheduled a message due
        # sooner, so the sleep ends at the next look allowed.
        assert promotion.promote(range(SHARD_COUNT), conn, None, now=100.01) == 0
        assert promotion.sleep_bound(30.0, now=100.01) == pytest.approx(0.09)
        assert promotion.promote(range(SHARD_COUNT), conn, None, now=100.2) == 0
        assert 4.0 < promotion.sleep_bound(30.0, now=100.2) <= 5.01


def test_the_commands_list_cancel_and_exit_1_when_nothing_changed(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    ob = Outbox(engine)
    with ob.transaction() as tx:
        first = tx.publish("orders", 1, key="k", deliver_after=600).message_id
        second = tx.publish("orders", 2, key="k", deliver_after=1200).message_id
        plain = tx.publish("orders", 3, key="k").message_id
    url = ["--database-url", outbox_url]
    listed = CliRunner().invoke(main, ["scheduled", "list", *url])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert [line.split()[0] for line in lines[:2]] == [str(first), str(second)]  # soonest first
    assert lines[-1] == "2 scheduled message(s)"
    cancelled = CliRunner().invoke(main, ["scheduled", "cancel", str(first), *url])
    assert (cancelled.exit_code, cancelled.output.strip()) == (
        0,
        "cancelled 1 scheduled message(s)",
    )
    again = CliRunner().invoke(main, ["scheduled", "cancel", str(first), str(plain), *url])
    assert again.exit_code == 1
    assert f"{first}: not scheduled (cancelled)" in again.output
    assert f"{plain}: not scheduled (pending)" in again.output
    report = read_status(engine, Queries(ob.spec), exact=True)
    (orders,) = report.topics
    assert (orders.scheduled, orders.overdue, orders.cancelled) == (1, 0, 1)
    assert orders.next_due_seconds is not None and 1000 < orders.next_due_seconds <= 1200
    assert report.statuses["scheduled"].count == 1
    with engine.begin() as conn:  # as if no relay ran for an hour
        conn.execute(sa.text("UPDATE outbox SET deliver_at = now() - interval '1 hour'"))
    status = CliRunner().invoke(main, ["status", *url])
    assert "overdue scheduled: 1 " in status.output, status.output


def test_the_immediate_sender_leaves_a_scheduled_message_to_the_relay(  # type: ignore[no-untyped-def]
    engine, bootstrap_servers, make_topic
) -> None:
    topic = make_topic("sched-imm")
    immediate = ImmediateSender(engine, {"bootstrap.servers": bootstrap_servers})
    try:
        ob = Outbox(engine, immediate=immediate)
        with ob.transaction() as tx:
            now = tx.publish(topic, "now", key="k").message_id
            later = tx.publish(topic, "later", key="k", deliver_after=600).message_id
        assert immediate.flush(30)
    finally:
        immediate.close(10)
    found = rows(engine)
    assert found[now].status == "sent"
    assert (found[later].status, found[later].lease_owner) == ("scheduled", None)


@pytest.mark.asyncio
async def test_the_async_api_schedules_and_cancels(outbox_url, engine) -> None:  # type: ignore[no-untyped-def]
    ob = Outbox(outbox_url)
    scheduled = ScheduledMessages(ob)
    try:
        async with ob.atransaction() as tx:
            result = await tx.publish("orders", 1, deliver_at=datetime.now(UTC) + timedelta(1))
            await scheduled.acancel(result.message_id, bind=tx.session)
        with pytest.raises(NotScheduled):
            await scheduled.acancel(uuid.uuid4())
    finally:
        await ob.async_engine.dispose()
    assert rows(engine)[result.message_id].status == "cancelled"


def test_a_prepared_message_committed_before_its_time_waits_scheduled(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine))
    early = prepared.prepare("orders", 1, key="k", deliver_after=3600)
    late = prepared.prepare("orders", 2, key="k", deliver_after=3600)
    with engine.begin() as conn:  # its time passed while its step ran
        conn.execute(
            sa.text("UPDATE outbox SET deliver_at = now() - interval '1 second' WHERE id = :id"),
            {"id": late.message_id},
        )
    early.commit()
    late.commit()
    early.commit()  # already committed (and scheduled): nothing to do
    found = rows(engine)
    assert found[early.message_id].status == "scheduled"
    assert found[late.message_id].status == "pending"
    assert promote_all(Outbox(engine).spec, outbox_url) == 0


def test_the_relay_does_not_wait_for_a_cancel_in_progress(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    ob = Outbox(engine)
    with ob.transaction() as tx:
        held = tx.publish("orders", 1, key="a", deliver_after=3600).message_id
        free = tx.publish("orders", 2, key="b", deliver_after=3600).message_id
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox SET deliver_at = now() - interval '1 second'"))
    scheduled = ScheduledMessages(ob)
    with ob.transaction() as tx:  # a service cancels inside a business transaction still open
        scheduled.cancel(held, bind=tx.session)
        started = time.monotonic()
        assert promote_all(ob.spec, outbox_url) == 1  # the other one, without waiting
        assert time.monotonic() - started < 5
        tx.session.rollback()  # the business step failed: the cancel with it
    assert rows(engine)[free].status == "pending"
    assert rows(engine)[held].status == "scheduled"
    assert promote_all(ob.spec, outbox_url) == 1  # its turn at the next look
    assert rows(engine)[held].status == "pending"


def test_show_prints_the_due_time(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    due = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)
    with Outbox(engine).transaction() as tx:
        message = tx.publish("orders", 1, deliver_at=due).message_id
    shown = CliRunner().invoke(
        main, ["scheduled", "show", str(message), "--database-url", outbox_url]
    )
    assert shown.exit_code == 0, shown.output
    assert "status  scheduled" in shown.output
    assert "deliver_at  2030-01-01 09:00:00+00:00" in shown.output


def test_the_relay_gauges_count_scheduled_and_overdue_messages(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    with Outbox(engine).transaction() as tx:
        for n in range(3):
            tx.publish("orders", n, key=f"k{n}", deliver_after=3600)
    with engine.begin() as conn:  # one of them overdue: no relay made it pending
        conn.execute(
            sa.text(
                "UPDATE outbox SET deliver_at = now() - interval '1 minute'"
                " WHERE seq = (SELECT min(seq) FROM outbox)"
            )
        )
    metrics = RelayMetrics()
    raw = engine.raw_connection()  # the gauges' psycopg session, as the relay's own
    try:
        ScheduledPromotion(DEFAULT_SPEC, metrics).refresh_gauges(raw.driver_connection)
    finally:
        raw.close()
    assert metrics.registry.get_sample_value("outbox_relay_scheduled") == 3
    assert metrics.registry.get_sample_value("outbox_relay_scheduled_overdue") == 1
    assert promote_all(DEFAULT_SPEC, outbox_url) == 1
    promoted = RelayMetrics()
    promotion = ScheduledPromotion(DEFAULT_SPEC, promoted)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox SET deliver_at = now() WHERE status = 'scheduled'"))
    with psycopg.connect(outbox_conninfo(outbox_url), autocommit=True) as conn:
        assert promotion.promote(range(SHARD_COUNT), conn, None) == 2
    assert promoted.registry.get_sample_value("outbox_relay_promoted_total") == 2


def read_buffers(url: str) -> int:
    """Shared buffers the relay's read of every shard touches (its session's settings)."""
    sql = str(Queries(DEFAULT_SPEC)["read_batch"].compile(dialect=psycopg_dialect.dialect()))  # type: ignore[no-untyped-call]
    params = {"shards": list(range(SHARD_COUNT)), "window": 100, "batch_size": 1000}
    params |= {"held_reach": HELD_REACH}
    params |= {"owner_key": None, **DEFAULT_SPEC.owner_session_keys}
    options = "-c plan_cache_mode=force_generic_plan -c jit=off -c enable_seqscan=off"
    with psycopg.connect(outbox_conninfo(url), autocommit=True, options=options) as conn:
        conn.execute("VACUUM ANALYZE outbox")
        plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
    assert plan is not None
    top = plan[0][0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


def test_a_backlog_of_future_messages_costs_the_read_nothing(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    with Outbox(engine).transaction() as tx:
        tx.publish_many([Message("orders", n, key=f"k{n}") for n in range(200)])
    alone = read_buffers(outbox_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox (id, shard, topic, key, value, status, deliver_at)"
                " SELECT gen_random_uuid(), i % 16, 'orders', convert_to('f' || i, 'UTF8'),"
                " '1', 'scheduled', now() + make_interval(secs => 3600 + i)"
                " FROM generate_series(1, 100000) AS i"
            )
        )
    assert read_buffers(outbox_url) == alone  # measured: the same buffers, to the block
