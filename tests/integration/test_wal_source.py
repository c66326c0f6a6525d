"""The WAL source on a real PostgreSQL: committed rows come by shard in commit order, a
position is settled only when everything before it is, a restart resumes from the confirmed
position, and the table says what a restarted stream must not send again."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence

import psycopg
import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.relay import wal_source
from outbox.relay.commands import (
    BatchEnded,
    Command,
    Probe,
    Probed,
    Read,
    Rebalance,
    Rebalanced,
    Record,
    Recorded,
    Recording,
    RowsRead,
    Send,
    TakenOver,
    TakeOver,
)
from outbox.relay.core import RelayCore
from outbox.relay.policy import RetryPolicy
from outbox.relay.store import RelayStore
from outbox.relay.wal_rows import unsettled_rows
from outbox.relay.wal_source import WalSource
from outbox.rows import Failure, PendingRow
from outbox.schema import DEFAULT_SPEC, SHARD_COUNT
from outbox.sending import Ack, BatchResult
from outbox.wal.lsn import parse_lsn
from outbox.wal.slots import slot_name
from tests.wal_helpers import (
    confirmed_on_server,
    conninfo,
    control,
    publish,
    terminate_and_drop,
    wait_for,
)

pytestmark = pytest.mark.integration

SLOT = slot_name(DEFAULT_SPEC)
EVERY_SHARD = tuple(range(SHARD_COUNT))


def read_all(shards: Sequence[int] = EVERY_SHARD, size: int = 100_000) -> Read:
    return Read(tuple(shards), size, size)


def wait_buffered(source: WalSource, count: int, timeout: float = 15.0) -> None:
    """Take in from the stream until ``count`` rows wait to be handed out."""
    deadline = time.monotonic() + timeout
    while source.buffered < count:
        assert time.monotonic() < deadline, f"only {source.buffered} of {count} rows came"
        source.take_in(0.2)


def settled_past(source: WalSource, position: int) -> None:
    """Take in until the settled position is past ``position`` (a Commit comes after its
    transaction's rows, maybe in a later read)."""

    def past() -> bool:
        source.take_in(0.1)
        return source.settled().position > position

    wait_for(past, what="the settled position to move")


_numbers = iter(range(1, 1_000_000))


def sent(source: WalSource, rows: Sequence[PendingRow]) -> None:
    """What the relay does once Kafka acknowledged ``rows``: their outcome is recorded."""
    acks = [Ack(row.id, 0, n) for n, row in enumerate(rows)]
    recording = Recording(next(_numbers), acks, [], {r.id: r.shard for r in rows}, 0.0)
    source.recorded(Recorded(recording))


def failed(source: WalSource, url: str, failures: Sequence[Failure], row: PendingRow) -> None:
    """A failure recorded as the recorder records it (on the row), then told to the source."""
    store = RelayStore(sa.create_engine(url), DEFAULT_SPEC, "test")
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        assert not store.record_unlocked([], failures, conn, None)
    store.engine.dispose()
    recording = Recording(next(_numbers), [], list(failures), {row.id: row.shard}, 0.0)
    source.recorded(Recorded(recording))


@pytest.fixture
def source(outbox_url: str) -> Iterator[WalSource]:
    with WalSource(outbox_url, heartbeat=None) as started:
        yield started


def test_rows_come_by_shard_in_commit_order(
    source: WalSource, engine: sa.Engine, outbox_url: str
) -> None:
    ob = Outbox(engine)
    # The first transaction to write commits last: its rows come last.
    with ob.transaction() as late:
        late_ids = [
            r.message_id for r in late.publish_many([Message("orders", n) for n in range(3)])
        ]
        with ob.transaction() as early:
            early_ids = [
                r.message_id
                for r in early.publish_many(
                    [
                        Message("orders", {"n": 1}, key="k1", headers={"trace": b"\x01"}),
                        *(Message("payments", n, key=f"p{n}") for n in range(5)),
                    ]
                )
            ]
    wait_buffered(source, 9)

    shards = {row.id: row.shard for row in source.read(read_all())}
    assert len(shards) == 9
    # Nothing settled: the rows handed out come again when their shards are read again.
    again = source.read(read_all())
    assert [row.id for row in again] == early_ids + late_ids  # commit order across shards
    first = again[0]
    assert first.record is not None and first.attempts == 0
    assert (first.record.topic, first.record.key) == ("orders", b"k1")
    assert dict(first.record.headers)["trace"] == b"\x01"
    assert dict(first.record.headers)["outbox-id"] == str(first.id).encode()
    with engine.connect() as conn:
        stored = dict(conn.execute(sa.text("SELECT id, shard FROM outbox")).all())
    assert shards == stored

    # A read of some shards hands out theirs only, and the others' stay for their reads.
    some = sorted(set(shards.values()))[:2]
    part = source.read(read_all(some))
    assert part and {row.shard for row in part} <= set(some)
    assert [row.id for row in part] == [i for i in early_ids + late_ids if shards[i] in some]
    sent(source, part)
    rest = source.read(read_all())
    assert {row.id for row in rest} == set(shards) - {row.id for row in part}


def test_a_read_takes_at_most_its_size_in_commit_order(
    source: WalSource, engine: sa.Engine
) -> None:
    ids = publish(engine, *(Message("orders", n, key=str(n)) for n in range(40)))
    wait_buffered(source, 40)
    first = source.read(Read(EVERY_SHARD, 10, 3))
    assert len(first) == 10
    assert all(sum(row.shard == s for row in first) <= 3 for s in EVERY_SHARD)
    positions = [ids.index(row.id) for row in first]
    assert positions == sorted(positions)
    sent(source, first)
    handed = list(first)
    while len(handed) < 40:
        rows = source.read(Read(EVERY_SHARD, 10, 3))
        assert rows
        sent(source, rows)
        handed += rows
    assert sorted(row.id for row in handed) == sorted(ids)  # each once
    assert source.read(read_all()) == []


def test_rows_of_a_rolled_back_transaction_never_come(source: WalSource, engine: sa.Engine) -> None:
    ob = Outbox(engine)
    with pytest.raises(RuntimeError), ob.transaction() as tx:
        tx.publish("orders", "rolled back", key="k")
        raise RuntimeError("the business transaction fails")
    with engine.connect() as conn:  # and one rolled back on a connection of the service's
        conn.begin()
        ob.publish(conn, "orders", "also rolled back", key="k")
        conn.rollback()
    kept = publish(engine, Message("orders", "committed", key="k"))
    wait_buffered(source, 1)
    source.take_in(0.5)  # anything else would have come by now
    rows = source.read(read_all())
    assert [row.id for row in rows] == kept
    sent(source, rows)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 1


def test_a_transaction_of_many_rows(outbox_url: str, engine: sa.Engine) -> None:
    """20,000 rows in one transaction stream through a small buffer; the position moves past
    the transaction only once every row of it is settled."""
    count = 20_000
    with WalSource(outbox_url, heartbeat=None, buffer_rows=3_000) as source:
        start = source.settled().position
        ids = publish(engine, *(Message("orders", n, key=str(n % 50)) for n in range(count)))
        handed: list[uuid.UUID] = []
        deadline = time.monotonic() + 60
        while len(handed) < count:
            assert time.monotonic() < deadline
            source.take_in(0.2)
            assert source.buffered <= 3_000
            rows = source.read(Read(EVERY_SHARD, 1_000, 1_000))
            if len(handed) + len(rows) < count:
                assert source.settled().position == start  # the transaction is not done
            sent(source, rows)
            handed += [row.id for row in rows]
        assert sorted(handed) == sorted(ids)
        by_id = {row_id: position for position, row_id in enumerate(ids)}
        for shard_rows in _by_shard(handed, engine).values():  # each shard's rows in order
            assert [by_id[i] for i in shard_rows] == sorted(by_id[i] for i in shard_rows)
        settled_past(source, start)


def _by_shard(ids: list[uuid.UUID], engine: sa.Engine) -> dict[int, list[uuid.UUID]]:
    with engine.connect() as conn:
        shard_of = dict(conn.execute(sa.text("SELECT id, shard FROM outbox")).all())
    by_shard: dict[int, list[uuid.UUID]] = {}
    for row_id in ids:
        by_shard.setdefault(shard_of[row_id], []).append(row_id)
    return by_shard


def test_the_position_is_settled_only_up_to_what_is_settled(
    source: WalSource, engine: sa.Engine, outbox_url: str
) -> None:
    start = source.settled().position
    first = publish(engine, Message("orders", 1), Message("orders", 2))
    second = publish(engine, Message("orders", 3))
    wait_buffered(source, 3)
    rows = {row.id: row for row in source.read(read_all())}

    sent(source, [rows[second[0]], rows[first[0]]])  # the later transaction, and half of one
    assert source.settled().position == start
    with pytest.raises(ValueError, match="past the settled position"):
        source.confirm(start + 1)

    sent(source, [rows[first[1]]])
    settled = source.settled()
    assert settled.position > start
    source.confirm(settled.position)
    source.take_in(0.1)  # sends the confirmed position
    wait_for(lambda: confirmed_on_server(outbox_url, SLOT) == settled.position, what="confirm")


def test_rows_not_settled_come_back_when_their_shard_is_read_again(
    source: WalSource, engine: sa.Engine
) -> None:
    """An outage, a suspect sent alone, a forgotten batch: the core reads the shard again,
    and what it did not settle is handed out again, first and in order."""
    ids = publish(engine, *(Message("orders", n, key="one key") for n in range(5)))
    wait_buffered(source, 5)
    first = source.read(read_all())
    assert [row.id for row in first] == ids
    sent(source, first[:2])
    again = source.read(read_all())
    assert [row.id for row in again] == ids[2:]
    sent(source, again)
    assert source.read(read_all()) == []


class Clock:
    """The retries' clock, moved by the test (a retry is due when the test says)."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_a_retry_waits_aside_and_holds_its_key_only(outbox_url: str, engine: sa.Engine) -> None:
    clock = Clock()
    with WalSource(outbox_url, heartbeat=None, clock=clock) as source:
        a1, b1 = publish(engine, Message("orders", "a1", key="a"), Message("orders", "b1", key="b"))
        a2, b2 = publish(engine, Message("orders", "a2", key="a"), Message("orders", "b2", key="b"))
        wait_buffered(source, 4)
        rows = {row.id: row for row in source.read(read_all())}
        start = source.settled().position
        sent(source, [rows[b1]])
        failed(source, outbox_url, [Failure(a1, "retriable", "timed out", 30.0)], rows[a1])
        assert source.settled().position > start  # the failure is the table's now

        # a2 waits behind a1; b2 goes
        assert [row.id for row in source.read(read_all())] == [b2]
        sent(source, [rows[b2]])
        clock.now += 29.9
        assert source.read(read_all()) == []
        clock.now += 0.1
        retried = source.read(read_all())
        assert [(row.id, row.attempts) for row in retried] == [(a1, 1)]
        sent(source, retried)
        assert [row.id for row in source.read(read_all())] == [a2]


def test_a_restart_resumes_from_the_confirmed_position(outbox_url: str, engine: sa.Engine) -> None:
    """Nothing confirmed is sent again, nothing not confirmed is lost; of what was settled
    and not confirmed, the table's outcomes hold (dead stays dead, a retry stays aside), and
    rows acknowledged go again (a duplicate, at-least-once)."""
    with WalSource(outbox_url, heartbeat=None) as source:
        confirmed = publish(engine, Message("orders", "c1", key="c"), Message("orders", "c2"))
        wait_buffered(source, 2)
        start = source.settled().position
        sent(source, source.read(read_all()))
        settled_past(source, start)  # (its Commit may come after its rows)
        position = source.settled().position
        source.confirm(position)
        dead, acked, aside = publish(
            engine,
            Message("orders", "dead", key="d"),
            Message("orders", "acked", key="e"),
            Message("orders", "aside", key="f"),
        )
        after_aside = publish(engine, Message("orders", "behind aside", key="f"))
        unsettled = publish(engine, Message("orders", "not settled", key="g"))
        wait_buffered(source, 5)
        rows = {row.id: row for row in source.read(read_all())}
        failed(
            source, outbox_url, [Failure(dead, "unknown_topic", "no such topic", None)], rows[dead]
        )
        failed(source, outbox_url, [Failure(aside, "retriable", "timed out", 30.0)], rows[aside])
        sent(source, [rows[acked]])
    # (stopped: what was settled since the confirm was not confirmed)
    assert confirmed_on_server(outbox_url, SLOT) == position

    clock = Clock()
    with WalSource(outbox_url, position=position, heartbeat=None, clock=clock) as again:
        wait_buffered(again, 3)  # acked, behind aside, not settled: not dead, not aside
        first = again.read(read_all())
        assert sorted(row.id for row in first) == sorted([acked, *unsettled])
        assert not {row.id for row in first} & set(confirmed)
        sent(again, first)
        assert again.read(read_all()) == []
        clock.now += 30  # the retry is due (the table said when)
        retried = again.read(read_all())
        assert [(row.id, row.attempts) for row in retried] == [(aside, 1)]
        sent(again, retried)
        assert [row.id for row in again.read(read_all())] == after_aside


@pytest.fixture
def short_sender_timeout(outbox_url: str) -> str:
    """The server ends a stream it hears nothing from for a second (this database only)."""
    database = sa.make_url(outbox_url).database
    with control(outbox_url) as conn:
        conn.execute(f'ALTER DATABASE "{database}" SET wal_sender_timeout = 1000')
    return outbox_url


def test_a_full_buffer_keeps_the_stream(
    short_sender_timeout: str, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a slow Kafka the source holds what it may and reads no more, for longer than
    the server waits to hear from a reader; then it goes on where it was."""
    monkeypatch.setattr(wal_source, "KEEP_ALIVE_SECONDS", 0.2)  # well within the timeout
    with WalSource(short_sender_timeout, heartbeat=None, buffer_rows=10) as source:
        ids = publish(engine, *(Message("orders", n, key="k") for n in range(50)))
        wait_buffered(source, 10)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # three timeouts, nothing settled
            assert not source.take_in(0.0)
            assert source.buffered == 10
            time.sleep(0.2)
        ids += publish(engine, Message("orders", "after", key="k"))  # the stream still streams
        handed: list[uuid.UUID] = []
        while len(handed) < 51:
            source.take_in(0.2)
            rows = source.read(read_all())
            sent(source, rows)
            handed += [row.id for row in rows]
    assert handed == ids


def test_after_a_lost_slot_the_horizon_finds_what_it_had_not_confirmed(
    outbox_url: str, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every message committed after the settled position, also one written before it by a
    transaction still open, is among the rows the recorded horizon finds in the table; those
    settled before the snapshot are not."""
    monkeypatch.setattr(wal_source, "HORIZON_SECONDS", 0.05)
    with WalSource(outbox_url, heartbeat=0.1) as source:
        early = publish(engine, Message("orders", "settled early"))
        wait_buffered(source, 1)
        sent(source, source.read(read_all()))
        with engine.connect() as long_running:
            long_running.begin()
            open_id = (
                Outbox(engine)
                .publish(long_running, "orders", "written before, committed after")
                .message_id
            )
            # The transaction stays open while the position moves past a snapshot.
            first = source.settled()

            with engine.begin() as conn:
                conn.execute(sa.text("CREATE TABLE other (n int)"))

            def moved_past_a_snapshot() -> bool:
                with engine.begin() as conn:  # the server's WAL moves on (heartbeats follow)
                    conn.execute(sa.text("INSERT INTO other VALUES (1)"))
                source.take_in(0.1)
                settled = source.settled()
                return settled.position > first.position and settled.horizon is not None

            wait_for(moved_past_a_snapshot, what="the position to pass a snapshot")
            recorded = source.settled()
            source.confirm(recorded.position)
            source.take_in(0.1)
            long_running.commit()
        late = publish(engine, Message("orders", "committed after the position"))
        wait_buffered(source, 2)  # handed out, never settled
    terminate_and_drop(outbox_url, SLOT)

    with control(outbox_url) as conn:
        found = {row.id for row in unsettled_rows(conn, recorded.horizon)}
        everything = {row.id for row in unsettled_rows(conn, None)}
    assert {open_id, *late} <= found
    assert not set(early) & found
    assert everything == {*early, open_id, *late}


def test_the_relay_core_sends_every_message_once_in_order(
    source: WalSource, engine: sa.Engine
) -> None:
    """The relay's own core reads the source as it reads the table: batches answered out of
    order, every message sent once, each key's in commit order, and the position settled at
    the end once all are."""
    ids = [
        publish(engine, *(Message("orders", [t, n], key=f"k{n % 20}") for n in range(300)))
        for t in range(2)
    ]
    with engine.connect() as conn:
        before_last = parse_lsn(conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one())
    ids.append(publish(engine, *(Message("orders", [2, n], key=f"k{n % 20}") for n in range(300))))
    core = RelayCore(
        exactly_once=False, batch_size=100, retry=RetryPolicy(), rebalance_interval=0.5
    )
    delivered: list[PendingRow] = []
    in_flight: list[Send] = []

    def execute(commands: Sequence[Command]) -> None:
        for command in commands:
            now = time.monotonic()
            if isinstance(command, Rebalance):
                execute(core.handle(Rebalanced(gained=EVERY_SHARD, joined=True), now))
            elif isinstance(command, TakeOver):
                execute(core.handle(TakenOver(command.shards), now))
            elif isinstance(command, Probe):
                execute(core.handle(Probed(True), now))
            elif isinstance(command, Send):
                in_flight.append(command)
            elif isinstance(command, Record):  # WAL mode: nothing to write for acks
                event = Recorded(command.recording)
                source.recorded(event)
                execute(core.handle(event, now))

    deadline = time.monotonic() + 30
    while len(delivered) < 900:
        assert time.monotonic() < deadline, f"{len(delivered)} of 900 sent"
        source.take_in(0.05)
        execute(core.tick(time.monotonic()))
        while (read := core.next_read(time.monotonic())) is not None:
            rows = source.read(read, sorted(core.owned))
            execute(core.handle(RowsRead(read, rows), time.monotonic()))
        while in_flight:  # Kafka answers the latest batch first
            batch = in_flight.pop().batch
            delivered += batch.rows
            acks = [Ack(row.id, 0, n) for n, row in enumerate(batch.rows)]
            execute(core.handle(BatchEnded(batch, BatchResult(acks=acks)), time.monotonic()))

    order = [row_id for transaction in ids for row_id in transaction]
    assert sorted(row.id for row in delivered) == sorted(order)  # each once
    for key in {f"k{n}".encode() for n in range(20)}:
        sent_ids = [row.id for row in delivered if row.record and row.record.key == key]
        assert sent_ids == [i for i in order if i in set(sent_ids)]
    settled_past(source, before_last)  # past the last transaction's commit
