"""The WAL reader on a real PostgreSQL: messages published through the publish API come out
of the slot in commit order, with their transactions, and the slot moves only when told."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.schema import DEFAULT_SPEC
from outbox.wal.pgoutput import Begin, Commit, WalMessage
from outbox.wal.reader import Heartbeat, Item, WalReader
from outbox.wal.slots import slot_name
from tests.wal_helpers import confirmed_on_server, publish, read_until, wait_for

pytestmark = pytest.mark.integration

SLOT = slot_name(DEFAULT_SPEC)


def messages(items: list[Item]) -> list[WalMessage]:
    return [i for i in items if isinstance(i, WalMessage)]


def commits(items: list[Item]) -> list[Commit]:
    return [i for i in items if isinstance(i, Commit)]


def test_messages_come_in_commit_order_with_their_transactions(
    outbox_url: str, engine: sa.Engine
) -> None:
    with WalReader(outbox_url, heartbeat=None) as reader:
        ob = Outbox(engine)
        # The first transaction to write commits last: the slot hands it out last.
        with ob.transaction() as late:
            late_id = late.publish("orders", {"n": 1}, key="k1").message_id
            with ob.transaction() as early:
                early_ids = [
                    r.message_id
                    for r in early.publish_many(
                        [
                            Message("orders", {"n": 2}, key="k2", headers={"trace": b"\x01"}),
                            Message("payments", b"raw", key=b"\x00\xff"),
                        ]
                    )
                ]
        items = read_until(reader, lambda got: len(commits(got)) == 2)

    assert [type(i) for i in items] == [Begin, WalMessage, WalMessage, Commit] * 1 + [
        Begin,
        WalMessage,
        Commit,
    ]
    first, second, third = messages(items)
    assert [first.id, second.id, third.id] == [*early_ids, late_id]
    assert (first.topic, first.key, first.header_names, first.header_values) == (
        "orders",
        b"k2",
        ["trace"],
        [b"\x01"],
    )
    assert first.content_type == "application/json"
    assert (second.topic, second.key, second.value) == ("payments", b"\x00\xff", b"raw")
    begin_early, commit_early, begin_late, commit_late = (
        items[0],
        items[3],
        items[4],
        items[6],
    )
    assert isinstance(begin_early, Begin) and isinstance(commit_early, Commit)
    assert isinstance(begin_late, Begin) and isinstance(commit_late, Commit)
    assert first.commit_lsn == second.commit_lsn == begin_early.commit_lsn
    assert third.commit_lsn == begin_late.commit_lsn == commit_late.commit_lsn
    assert first.lsn < second.lsn < first.commit_lsn < commit_early.end_lsn
    assert commit_early.end_lsn <= begin_late.commit_lsn
    # the row as stored: the WAL carries what the table holds
    with engine.connect() as conn:
        stored = conn.execute(
            sa.text("SELECT value, shard, seq FROM outbox WHERE id = :id"), {"id": third.id}
        ).one()
    assert (third.value, third.shard, third.seq) == tuple(stored)


def test_messages_not_sendable_yet_are_not_decoded(outbox_url: str, engine: sa.Engine) -> None:
    with WalReader(outbox_url, heartbeat=None) as reader:
        ob = Outbox(engine)
        with ob.transaction() as tx:
            tx.publish("orders", {"later": True}, deliver_after=3600)
            sendable = tx.publish("orders", {"now": True}).message_id
        items = read_until(reader, lambda got: len(commits(got)) == 1)
    assert [m.id for m in messages(items)] == [sendable]


def test_the_slot_moves_only_to_what_was_confirmed(outbox_url: str, engine: sa.Engine) -> None:
    reader = WalReader(outbox_url, heartbeat=None)
    start = reader.start()
    try:
        first = publish(engine, Message("orders", 1))
        second = publish(engine, Message("orders", 2))
        items = read_until(reader, lambda got: len(commits(got)) == 2)
        reader.flush()
        assert confirmed_on_server(outbox_url, SLOT) == start  # read, not confirmed

        end_of_first = commits(items)[0].end_lsn
        reader.confirm(end_of_first)
        reader.flush()
        wait_for(lambda: confirmed_on_server(outbox_url, SLOT) == end_of_first, what="confirm")
        with pytest.raises(ValueError, match="handed out only up to"):
            reader.confirm(commits(items)[1].end_lsn + 1)
    finally:
        reader.close()

    # A new reader from the recorded position gets what was not confirmed, again.
    with WalReader(outbox_url, position=end_of_first, heartbeat=None) as again:
        replayed = read_until(again, lambda got: len(commits(got)) == 1)
    assert [m.id for m in messages(replayed)] == second
    assert [m.id for m in messages(items)] == first + second


def test_an_idle_reader_hands_out_heartbeats(outbox_url: str, engine: sa.Engine) -> None:
    with WalReader(outbox_url, heartbeat=0.2) as reader:
        start = reader.confirmed
        with engine.begin() as conn:  # WAL that is not the outbox's
            conn.execute(sa.text("CREATE TABLE other (n int)"))
            conn.execute(sa.text("INSERT INTO other SELECT generate_series(1, 1000)"))
        items = read_until(reader, lambda got: any(isinstance(i, Heartbeat) for i in got))
        beat = next(i for i in items if isinstance(i, Heartbeat))
        assert not messages(items)
        assert beat.lsn > start
        reader.confirm(beat.lsn)
        reader.flush()
        wait_for(lambda: confirmed_on_server(outbox_url, SLOT) == beat.lsn, what="the beat")


def test_a_large_transaction_comes_in_parts(outbox_url: str, engine: sa.Engine) -> None:
    """A transaction of many messages is handed out as it streams, a read at a time: the
    reader never holds it whole."""
    count = 20_000
    with WalReader(outbox_url, heartbeat=None) as reader:
        publish(engine, *(Message("orders", n, key=str(n % 7)) for n in range(count)))
        reads: list[list[Item]] = []
        ended = False
        while not ended:
            assert len(reads) < 1_000, "the transaction never ended"
            reads.append(reader.read(5_000, 1.0))
            ended = any(isinstance(i, Commit) for i in reads[-1])
    items = [item for part in reads for item in part]
    assert len([r for r in reads if messages(r)]) >= count // 5_000
    assert [type(i) for i in items] == [Begin] + [WalMessage] * count + [Commit]
    assert len({m.commit_lsn for m in messages(items)}) == 1
    lsns = [m.lsn for m in messages(items)]
    assert lsns == sorted(lsns)


def test_a_partitioned_table_streams_as_the_table(database_url: str) -> None:
    from outbox import migrate

    migrate.upgrade(database_url, partitioned="daily")
    engine = sa.create_engine(database_url)
    try:
        with WalReader(database_url, heartbeat=None) as reader:
            ids = publish(engine, Message("orders", 1), Message("orders", 2))
            items = read_until(reader, lambda got: len(commits(got)) == 1)
    finally:
        engine.dispose()
    assert [m.id for m in messages(items)] == ids


def test_a_publication_changed_by_hand_is_refused(outbox_url: str) -> None:
    from outbox.wal.errors import PublicationMismatch
    from tests.wal_helpers import control

    with WalReader(outbox_url, heartbeat=None):
        pass
    with control(outbox_url) as conn:
        conn.execute(f"ALTER PUBLICATION {SLOT} SET (publish = 'insert, update')")
    with pytest.raises(PublicationMismatch, match=f"DROP PUBLICATION {SLOT}"):
        WalReader(outbox_url).start()


@pytest.fixture
def short_sender_timeout(outbox_url: str) -> str:
    """The server ends a stream it hears nothing from for a second (this database only)."""
    from tests.wal_helpers import control

    database = sa.make_url(outbox_url).database
    with control(outbox_url) as conn:
        conn.execute(f'ALTER DATABASE "{database}" SET wal_sender_timeout = 1000')
    return outbox_url


def test_a_stream_the_server_ends_is_a_stream_error(short_sender_timeout: str) -> None:
    """Not psycopg's own OperationalError: the caller reconnects on StreamError (or recovers
    on SlotLost, which the reader can tell only from a StreamError)."""
    from outbox.wal.stream import StreamError

    with WalReader(short_sender_timeout, heartbeat=None) as reader:
        time.sleep(3)  # silent well past wal_sender_timeout
        with pytest.raises(StreamError):
            read_until(reader, lambda got: False, timeout=5)


def test_keep_alive_keeps_a_stream_not_read(short_sender_timeout: str, engine: sa.Engine) -> None:
    with WalReader(short_sender_timeout, heartbeat=None) as reader:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # three timeouts, nothing read
            reader.keep_alive()
            time.sleep(0.2)
        ids = publish(engine, Message("orders", "still there"))
        items = read_until(reader, lambda got: len(commits(got)) == 1)
    assert [m.id for m in messages(items)] == ids
