"""The publish API on the real PostgreSQL: atomicity, savepoints, bulk, idempotency, errors."""

from __future__ import annotations

import datetime as dt
import decimal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import outbox
from outbox import Message, Outbox

pytestmark = pytest.mark.integration


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    total: Mapped[int]


@dataclass
class OrderPlaced:
    order_id: int
    total: int


@pytest.fixture
def ob(engine: sa.Engine) -> Outbox:
    Base.metadata.create_all(engine)
    return Outbox(engine)


def outbox_rows(engine: sa.Engine) -> list[sa.Row]:  # type: ignore[type-arg]
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT id, topic, key, value, content_type, header_names, header_values, "
                    "status, shard, "
                    "idempotency_key FROM outbox ORDER BY seq"
                )
            )
        )


def order_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM orders")).scalar_one())


def test_transaction_commits_business_row_and_message_together(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    with ob.transaction() as tx:
        tx.session.add(Order(id=1, total=30))
        result = tx.publish("orders", OrderPlaced(1, 30), key=1, headers={"trace": "abc"})
    rows = outbox_rows(engine)
    assert order_count(engine) == 1
    assert len(rows) == 1
    row = rows[0]
    assert row.id == result.message_id and row.id.version == 7
    assert (row.topic, row.key, row.status) == ("orders", b"1", "pending")
    assert row.value == b'{"order_id":1,"total":30}'
    assert row.content_type == "application/json"
    assert row.header_names == ["trace"]
    assert row.header_values == [b"abc"]
    assert not result.duplicate


def test_exception_in_transaction_rolls_back_both(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ZeroDivisionError), ob.transaction() as tx:
        tx.session.add(Order(id=1, total=30))
        tx.publish("orders", {"id": 1}, key=1)
        _ = 1 / 0
    assert order_count(engine) == 0
    assert outbox_rows(engine) == []


def test_joined_session_rollback_discards_messages(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    with Session(engine) as session:
        session.add(Order(id=2, total=5))
        outbox.publish(session, "orders", {"id": 2})
        session.rollback()
        session.add(Order(id=3, total=7))
        outbox.publish(session, "orders", {"id": 3})
        session.commit()
    assert [r.value for r in outbox_rows(engine)] == [b'{"id":3}']
    assert order_count(engine) == 1


def test_savepoint_rollback_drops_only_its_messages(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    with ob.transaction() as tx:
        tx.publish("orders", b"outer-before")
        savepoint = tx.session.begin_nested()
        tx.publish("orders", b"inside-rolled-back")
        savepoint.rollback()
        with tx.session.begin_nested():
            tx.publish("orders", b"inside-kept")
        tx.publish("orders", b"outer-after")
    assert [r.value for r in outbox_rows(engine)] == [
        b"outer-before",
        b"inside-kept",
        b"outer-after",
    ]


def test_core_connection_in_transaction(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        with conn.begin():
            conn.execute(sa.text("INSERT INTO orders VALUES (9, 1)"))
            ob.publish(conn, "orders", {"id": 9}, key="nine")
        with conn.begin():
            ob.publish(conn, "orders", {"id": 10})
            conn.rollback()
    rows = outbox_rows(engine)
    assert [(r.key, r.value) for r in rows] == [(b"nine", b'{"id":9}')]


def test_publish_outside_a_transaction_is_refused(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    with engine.connect() as conn, pytest.raises(outbox.NotInTransaction, match="inside a"):
        ob.publish(conn, "orders", b"x")
    autocommit = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    with autocommit as conn, conn.begin(), pytest.raises(outbox.NotInTransaction, match="AUTO"):
        ob.publish(conn, "orders", b"x")
    with Session(engine, autobegin=False) as session, pytest.raises(outbox.NotInTransaction):
        ob.publish(session, "orders", b"x")
    assert outbox_rows(engine) == []


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"topic": "bad topic"}, outbox.InvalidTopic),
        ({"topic": ".."}, outbox.InvalidTopic),
        ({"topic": "t" * 250}, outbox.InvalidTopic),
        ({"value": object()}, outbox.SerializationError),
        ({"value": {"price": float("nan")}}, outbox.SerializationError),
        ({"value": {"at": dt.datetime(2026, 1, 2)}}, outbox.SerializationError),
        ({"value": [decimal.Decimal("Infinity")]}, outbox.SerializationError),
        ({"value": b"x" * 2_000}, outbox.PayloadTooLarge),
        ({"key": 1.5}, outbox.InvalidKey),
        ({"headers": {"h": 5}}, outbox.InvalidHeaders),
        ({"headers": [("outbox-id", b"forged")]}, outbox.InvalidHeaders),
    ],
)
def test_bad_input_fails_before_commit_and_leaves_the_transaction_usable(
    engine: sa.Engine,
    kwargs: dict[str, Any],
    error: type[Exception],
) -> None:
    Base.metadata.create_all(engine)
    ob = Outbox(engine, max_message_bytes=1_000)
    arguments = {"topic": "orders", "value": b"ok", **kwargs}
    with ob.transaction() as tx:
        tx.session.add(Order(id=1, total=1))
        with pytest.raises(error) as caught:
            tx.publish(arguments.pop("topic"), arguments.pop("value"), **arguments)
        assert isinstance(caught.value, outbox.InvalidMessage)
        tx.publish("orders", b"still fine")  # the transaction is not poisoned
    assert order_count(engine) == 1
    assert [r.value for r in outbox_rows(engine)] == [b"still fine"]


def test_a_value_json_cannot_hold_raises_before_commit_and_leaves_no_row(
    engine: sa.Engine,
) -> None:
    Base.metadata.create_all(engine)
    ob = Outbox(engine)
    with pytest.raises(outbox.SerializationError, match="NaN"), ob.transaction() as tx:
        tx.session.add(Order(id=1, total=1))
        tx.publish("orders", {"total": decimal.Decimal("1.50")})
        tx.publish("orders", {"ratio": float("inf")})
    assert order_count(engine) == 0
    assert outbox_rows(engine) == []
    with ob.transaction() as tx:
        tx.publish("orders", {"total": decimal.Decimal("1.50")})
    assert [r.value for r in outbox_rows(engine)] == [b'{"total":"1.50"}']


def test_one_bad_message_in_a_batch_writes_none(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    with ob.transaction() as tx, pytest.raises(outbox.InvalidTopic):
        tx.publish_many([Message("orders", b"1"), Message("no/slash", b"2")])
    assert outbox_rows(engine) == []


def test_missing_table_says_to_run_the_migrations(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    try:
        ob = Outbox(engine)
        with ob.transaction() as tx:
            with pytest.raises(outbox.OutboxTableMissing, match="outbox db upgrade"):
                tx.publish("orders", b"x")
            tx.session.execute(sa.text("SELECT 1"))  # still usable
    finally:
        engine.dispose()


def test_publish_many_is_one_round_trip(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    statements: list[str] = []
    with ob.transaction() as tx:
        tx.publish("orders", b"warm-up")  # the one-off table check happens here

        def record(conn, cursor, statement, *args) -> None:  # type: ignore[no-untyped-def]
            statements.append(statement)

        sa.event.listen(engine, "before_cursor_execute", record)
        results = tx.publish_many([Message("orders", {"n": i}, key=i % 3) for i in range(10)])
        sa.event.remove(engine, "before_cursor_execute", record)
    inserts = [s for s in statements if s.lstrip().upper().startswith("INSERT")]
    assert len(inserts) == 1, statements
    rows = outbox_rows(engine)[1:]
    assert [r.id for r in rows] == [r.message_id for r in results]
    assert [r.value for r in rows] == [f'{{"n":{i}}}'.encode() for i in range(10)]
    # one key, one shard: that is what keeps a key's messages in order
    assert len({r.shard for r in rows if r.key == b"1"}) == 1


def test_idempotency_key_writes_once_and_reports_the_duplicate(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    with ob.transaction() as tx:
        first = tx.publish("orders", b"a", idempotency_key="order-1-placed")
    with ob.transaction() as tx:
        again = tx.publish("orders", b"a-again", idempotency_key="order-1-placed")
        batch = tx.publish_many(
            [
                Message("orders", b"b", idempotency_key="order-2-placed"),
                Message("orders", b"b-twice", idempotency_key="order-2-placed"),
                Message("orders", b"c"),
            ]
        )
    assert not first.duplicate
    assert again.duplicate and again.message_id == first.message_id
    assert [r.duplicate for r in batch] == [False, True, False]
    assert batch[1].message_id == batch[0].message_id
    assert [r.value for r in outbox_rows(engine)] == [b"a", b"b", b"c"]


def test_sixteen_threads_lose_and_duplicate_nothing(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    per_thread = 50
    published: list[uuid.UUID] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def writer(worker: int) -> None:
        try:
            for i in range(per_thread):
                order_id = worker * 1000 + i
                with ob.transaction() as tx:
                    tx.session.add(Order(id=order_id, total=i))
                    result = tx.publish("orders", {"id": order_id}, key=order_id)
                    if i % 10 == 9:
                        tx.session.rollback()  # a business failure: neither row survives
                        continue
                with lock:
                    published.append(result.message_id)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    rows = outbox_rows(engine)
    assert len(published) == 16 * 45
    assert sorted(r.id for r in rows) == sorted(published)
    assert order_count(engine) == len(published)


def test_concurrent_writers_of_one_idempotency_key_write_it_once(ob: Outbox, engine) -> None:  # type: ignore[no-untyped-def]
    first_in = threading.Event()
    release_first = threading.Event()
    results: dict[str, outbox.PublishResult] = {}

    def first() -> None:
        with ob.transaction() as tx:
            results["first"] = tx.publish("orders", b"first", idempotency_key="k-1")
            first_in.set()
            release_first.wait(10)

    def second() -> None:
        first_in.wait(10)
        with ob.transaction() as tx:  # blocks on the unique index until `first` commits
            results["second"] = tx.publish("orders", b"second", idempotency_key="k-1")
            tx.publish("orders", b"after")  # the transaction is still good

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    first_in.wait(10)
    time.sleep(0.5)  # let `second` reach the index and wait there
    release_first.set()
    for thread in threads:
        thread.join(20)
    assert not results["first"].duplicate
    assert results["second"].duplicate
    assert results["second"].message_id == results["first"].message_id
    assert [r.value for r in outbox_rows(engine)] == [b"first", b"after"]
