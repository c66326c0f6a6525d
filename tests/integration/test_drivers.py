"""Every publishing path on every SQLAlchemy PostgreSQL driver a service may run: psycopg2 and
psycopg 3 (sync), asyncpg and psycopg 3 (async), each through a Session and a Connection of
the service's own, on a real PostgreSQL (and Kafka, for immediate send).

The paths: publish and publish_many (plain, bulk, scheduled beside plain), idempotency keys
(also two transactions racing for one key), scheduled messages cancelled in the caller's
transaction, prepared messages and send_in_transaction, the step log's checker, immediate
send after commit, and outbox.testing (PublishedMessages, InboxFeeder, throwaway_database).
Rows written through any driver are the same bytes as through psycopg 3.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox
from outbox import Message, Outbox
from outbox.prepared import COMMIT, ROLLBACK, PreparedMessages, StepInProgress, StepLog
from outbox.scheduled.api import ScheduledMessages
from outbox.testing import InboxFeeder, PublishedMessages, throwaway_database
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Driver:
    name: str
    scheme: str
    is_async: bool


DRIVERS = [
    Driver("psycopg2", "postgresql+psycopg2", False),
    Driver("psycopg", "postgresql+psycopg", False),
    Driver("asyncpg", "postgresql+asyncpg", True),
    Driver("psycopg-async", "postgresql+psycopg", True),
]
BINDS = ("session", "connection")


def with_driver(url: str, driver: Driver) -> str:
    return sa.make_url(url).set(drivername=driver.scheme).render_as_string(hide_password=False)


class Service:
    """A service's own engine on one driver, with a sync face for the tests: a transaction
    on a Session or a Connection (``bind``), and the outbox's calls in it. An async service
    runs on an event loop of its own, in the thread that made it."""

    def __init__(self, url: str, driver: Driver, bind: str = "session", **outbox: Any) -> None:
        self.driver, self.bind_kind = driver, bind
        self.url = with_driver(url, driver)
        self.loop = asyncio.new_event_loop() if driver.is_async else None
        self.engine: sa.Engine | AsyncEngine
        if self.loop is not None:
            self.engine = self.run(_make_async_engine(self.url))
        else:
            self.engine = sa.create_engine(self.url)
        self.outbox = Outbox(self.engine, **outbox)

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        assert self.loop is not None
        return self.loop.run_until_complete(coroutine)

    def close(self) -> None:
        if isinstance(self.engine, AsyncEngine):
            self.run(self.engine.dispose())
            assert self.loop is not None
            self.loop.close()
        else:
            self.engine.dispose()

    @contextmanager
    def transaction(self, rollback: bool = False) -> Iterator[Any]:
        """A transaction of the service's (committed, or rolled back) on its bind."""
        if isinstance(self.engine, AsyncEngine):
            if self.bind_kind == "session":
                session = AsyncSession(self.engine)
                self.run(session.begin())
                try:
                    yield session
                finally:
                    self.run(session.rollback() if rollback else session.commit())
                    self.run(session.close())
            else:
                conn = self.run(self.engine.connect())
                transaction = self.run(conn.begin())
                try:
                    yield conn
                finally:
                    self.run(transaction.rollback() if rollback else transaction.commit())
                    self.run(conn.close())
            return
        if self.bind_kind == "session":
            with Session(self.engine) as session:
                session.begin()
                try:
                    yield session
                finally:
                    session.rollback() if rollback else session.commit()
        else:
            with self.engine.connect() as conn:
                transaction = conn.begin()
                try:
                    yield conn
                finally:
                    transaction.rollback() if rollback else transaction.commit()

    def publish(self, bind: Any, topic: str, value: Any = None, **options: Any) -> Any:
        if self.loop is not None:
            return self.run(self.outbox.apublish(bind, topic, value, **options))
        return self.outbox.publish(bind, topic, value, **options)

    def publish_many(self, bind: Any, messages: list[Message]) -> Any:
        if self.loop is not None:
            return self.run(self.outbox.apublish_many(bind, messages))
        return self.outbox.publish_many(bind, messages)

    def cancel(self, bind: Any, message_id: uuid.UUID) -> None:
        scheduled = ScheduledMessages(self.outbox)
        if self.loop is not None:
            self.run(scheduled.acancel(message_id, bind=bind))
        else:
            scheduled.cancel(message_id, bind=bind)

    def sync_call(self, bind: Any, call: Callable[[Any], Any]) -> Any:
        """``call(sync_bind)`` on the transaction's sync face (an async bind's ``run_sync``)."""
        if self.loop is not None:
            return self.run(bind.run_sync(call))
        return call(bind)


async def _make_async_engine(url: str) -> AsyncEngine:
    return create_async_engine(url)


@pytest.fixture(
    params=[(d, b) for d in DRIVERS for b in BINDS], ids=lambda p: f"{p[0].name}-{p[1]}"
)
def service(request: pytest.FixtureRequest, outbox_url: str) -> Iterator[Service]:
    driver, bind = request.param
    made = Service(outbox_url, driver, bind)
    yield made
    made.close()


@pytest.fixture(params=DRIVERS, ids=lambda d: d.name)
def driver(request: pytest.FixtureRequest) -> Driver:
    return request.param  # type: ignore[no-any-return]


def rows(engine: sa.Engine) -> list[sa.RowMapping]:
    with engine.connect() as conn:
        query = (
            "SELECT id, topic, key, value, content_type, header_names, header_values, shard, "
            "status, deliver_at, idempotency_key FROM outbox ORDER BY seq"
        )
        return list(conn.execute(sa.text(query)).mappings())


# -- publish, publish_many, scheduled, idempotency keys --------------------------------------


def test_publish_commits_with_the_transaction_and_writes_the_rows_psycopg_writes(
    service: Service, engine: sa.Engine, outbox_url: str
) -> None:
    message = {"topic": "orders", "value": {"order_id": 7}, "key": 7, "headers": {"h": "v"}}
    with service.transaction() as bind:
        written = service.publish(bind, **message)
    with service.transaction(rollback=True) as bind:
        service.publish(bind, "orders", {"order_id": 8}, key=8)
    # The same message through psycopg 3, the driver every other test runs.
    with Outbox(engine).transaction() as tx:
        tx.publish(**message)
    (ours, reference) = rows(engine)
    assert ours["id"] == written.message_id
    columns = ("topic", "key", "value", "content_type", "header_names", "header_values", "shard")
    assert [ours[c] for c in columns] == [reference[c] for c in columns]
    assert ours["status"] == "pending"


def test_publish_many_writes_plain_and_scheduled_messages_in_one_call(
    service: Service, engine: sa.Engine
) -> None:
    messages = [
        Message("orders", {"n": 1}, key=1),
        Message("orders", {"n": 2}, key=2, deliver_after=3600),
        Message("orders", {"n": 3}),
    ]
    with service.transaction() as bind:
        results = service.publish_many(bind, messages)
    stored = rows(engine)
    assert [r["id"] for r in stored] == [
        results[0].message_id,
        results[2].message_id,
        results[1].message_id,
    ]
    assert [r["status"] for r in stored] == ["pending", "pending", "scheduled"]
    assert stored[2]["deliver_at"] is not None


def test_a_scheduled_message_is_cancelled_in_the_callers_transaction(
    service: Service, engine: sa.Engine
) -> None:
    with service.transaction() as bind:
        kept = service.publish(bind, "orders", {"n": 1}, deliver_after=timedelta(hours=1))
        gone = service.publish(bind, "orders", {"n": 2}, deliver_after=timedelta(hours=1))
        service.cancel(bind, gone.message_id)
    with service.transaction(rollback=True) as bind:
        service.cancel(bind, kept.message_id)  # rolled back with the transaction
    assert {r["id"]: r["status"] for r in rows(engine)} == {
        kept.message_id: "scheduled",
        gone.message_id: "cancelled",
    }


def test_an_idempotency_key_writes_once(service: Service, engine: sa.Engine) -> None:
    with service.transaction() as bind:
        first = service.publish(bind, "orders", b"a", idempotency_key="order-7")
        batch = service.publish_many(
            bind,
            [Message("orders", b"b", idempotency_key="order-7"), Message("orders", b"c")],
        )
    with service.transaction() as bind:
        again = service.publish(bind, "orders", b"d", idempotency_key="order-7")
    assert not first.duplicate
    assert batch[0].duplicate and batch[0].message_id == first.message_id
    assert again.duplicate and again.message_id == first.message_id
    assert [r["value"] for r in rows(engine)] == [b"a", b"c"]


def test_two_transactions_racing_for_one_key_write_it_once(
    service: Service, engine: sa.Engine, outbox_url: str
) -> None:
    """The second waits on the unique index until the first commits, then finds the key
    taken: the insert's savepoint rolls back and the transaction goes on (the driver's error
    must say which index refused it)."""
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def second() -> None:
        other = Service(outbox_url, service.driver, service.bind_kind)
        try:
            with other.transaction() as bind:
                results["second"] = other.publish(bind, "orders", b"second", idempotency_key="k")
                other.publish(bind, "orders", b"after")  # the transaction is still good
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            other.close()

    thread = threading.Thread(target=second)
    with service.transaction() as bind:
        results["first"] = service.publish(bind, "orders", b"first", idempotency_key="k")
        thread.start()
        wait_for(lambda: waiting_on_a_lock(engine), 30, "the second writer waiting on the index")
    thread.join(30)
    assert errors == []
    assert results["second"].duplicate
    assert results["second"].message_id == results["first"].message_id
    assert [r["value"] for r in rows(engine)] == [b"first", b"after"]


def waiting_on_a_lock(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                )
            ).scalar()
        )


def test_a_missing_table_is_named_before_the_transaction_breaks(
    service: Service, engine: sa.Engine
) -> None:
    missing = Outbox(service.engine, table="no_such_outbox")
    with service.transaction() as bind:
        if service.loop is not None:
            with pytest.raises(outbox.OutboxTableMissing, match="no_such_outbox"):
                service.run(missing.apublish(bind, "orders", b"x"))
        else:
            with pytest.raises(outbox.OutboxTableMissing, match="no_such_outbox"):
                missing.publish(bind, "orders", b"x")
        service.publish(bind, "orders", b"still good")
    assert [r["value"] for r in rows(engine)] == [b"still good"]


# -- prepared messages and the step log ------------------------------------------------------


def test_prepared_messages_commit_roll_back_and_send_in_transaction(
    driver: Driver, outbox_url: str, engine: sa.Engine
) -> None:
    service = Service(outbox_url, driver)
    prepared = PreparedMessages(service.outbox, check_after=60)
    try:
        if service.loop is not None:
            kept = service.run(prepared.aprepare("orders", {"n": 1}, key=1, idempotency_key="p1"))
            dropped = service.run(prepared.aprepare("orders", {"n": 2}, key=2))
            again = service.run(prepared.aprepare("orders", {"n": 1}, idempotency_key="p1"))
            service.run(kept.acommit())
            service.run(dropped.arollback())

            async def local(message_id: uuid.UUID) -> Any:
                return COMMIT

            sent = service.run(prepared.asend_in_transaction(Message("orders", {"n": 3}), local))
        else:
            kept = prepared.prepare("orders", {"n": 1}, key=1, idempotency_key="p1")
            dropped = prepared.prepare("orders", {"n": 2}, key=2)
            again = prepared.prepare("orders", {"n": 1}, idempotency_key="p1")
            kept.commit()
            dropped.rollback()
            sent = prepared.send_in_transaction(Message("orders", {"n": 3}), lambda _: COMMIT)
    finally:
        service.close()
    assert again.duplicate and again.message_id == kept.message_id
    assert sent.resolved and sent.answer is COMMIT
    statuses = {r["id"]: r["status"] for r in rows(engine)}
    assert statuses == {
        kept.message_id: "pending",
        dropped.message_id: "rolled_back",
        sent.message_id: "pending",
    }


@pytest.mark.parametrize("driver", [d for d in DRIVERS if not d.is_async], ids=lambda d: d.name)
def test_the_step_log_answers_on_the_steps_own_driver(
    driver: Driver, outbox_url: str, engine: sa.Engine
) -> None:
    """StepLog runs on the step's database, whatever driver the service runs there; a step
    still holding its message id is reported as in progress, never abandoned."""
    from outbox.prepared import CheckMessage

    steps_engine = sa.create_engine(with_driver(outbox_url, driver))
    steps = StepLog()
    steps.create(steps_engine)
    done, held, late = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    try:
        with steps_engine.begin() as conn:
            steps.record(conn, done)

        def message(message_id: uuid.UUID) -> CheckMessage:
            return CheckMessage(
                id=message_id, topic="orders", key=None, value=b"", headers=(), group="orders",
                prepared_at=datetime.now(UTC), checks=1, age_at_claim=timedelta(minutes=5),
            )  # fmt: skip

        assert steps.answer(steps_engine, message(done)) is COMMIT
        assert steps.answer(steps_engine, message(late)) is ROLLBACK  # abandoned now
        with steps_engine.connect() as step:
            transaction = step.begin()
            steps.record(step, held)  # the step's transaction is still open
            with pytest.raises(StepInProgress):
                steps.answer(steps_engine, message(held), lock_timeout=timedelta(seconds=0.2))
            transaction.commit()
        assert steps.answer(steps_engine, message(held)) is COMMIT
    finally:
        steps_engine.dispose()


# -- immediate send ----------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda d: d.name)
def test_immediate_send_sends_what_a_session_of_any_driver_committed(
    driver: Driver, outbox_url: str, engine: sa.Engine, bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("drivers")
    # The sender connects with psycopg 3 whatever the service's engine runs: given that
    # engine (an async one's sync_engine), as docs/immediate-send.md says.
    service = Service(outbox_url, driver, "session")
    engine_of = (
        service.engine.sync_engine if isinstance(service.engine, AsyncEngine) else service.engine
    )
    sender = outbox.ImmediateSender(engine_of, {"bootstrap.servers": bootstrap_servers})
    service.outbox = Outbox(service.engine, immediate=sender)
    try:
        with service.transaction() as session:
            written = service.publish(session, topic, {"n": 1}, key=1)
        assert sender.flush(30)

        def sent() -> bool:
            with engine.connect() as conn:
                status = conn.execute(
                    sa.text("SELECT status FROM outbox WHERE id = :id"),
                    {"id": written.message_id},
                ).scalar()
            return status == "sent"

        wait_for(sent, 30, "the immediate sender's send")
    finally:
        service.close()
        sender.close()


# -- outbox.testing ----------------------------------------------------------------------------


def test_published_messages_see_what_a_service_of_any_driver_committed(
    service: Service, engine: sa.Engine
) -> None:
    watchers = [PublishedMessages(service.url), PublishedMessages(service.engine)]  # type: ignore[arg-type]
    with service.transaction() as bind:
        service.publish(bind, "orders", {"n": 1}, key=1, headers={"h": "v"})
        inside = service.sync_call(bind, lambda sync: watchers[0].values("orders", bind=sync))
        watchers[1].assert_none()  # not committed yet
    with service.transaction(rollback=True) as bind:
        service.publish(bind, "orders", {"n": 2}, key=2)
    assert inside == [{"n": 1}]
    for watcher in watchers:
        message = watcher.one("orders")
        assert (message.key, message.value, message.header("h")) == (b"1", {"n": 1}, b"v")
        watcher.close()


@pytest.mark.parametrize(
    "driver", [d for d in DRIVERS if d.name in ("psycopg2", "asyncpg")], ids=lambda d: d.name
)  # psycopg 3's: tests/integration/test_testing_helpers.py
def test_an_inbox_is_fed_on_a_database_of_any_driver(driver: Driver, postgres_server) -> None:  # type: ignore[no-untyped-def]
    from outbox.inbox import Inbox, InboxMessage

    inbox = Inbox(group=f"drivers-{driver.name}")
    seen: list[Any] = []
    if driver.is_async:

        @inbox.handler("orders")
        async def handle_async(message: InboxMessage, session: AsyncSession) -> None:
            await session.execute(
                sa.text("INSERT INTO shipped VALUES (:n)"), {"n": message.value["n"]}
            )
            seen.append(message.value["n"])

    else:

        @inbox.handler("orders")
        def handle(message: InboxMessage, session: Session) -> None:
            session.execute(sa.text("INSERT INTO shipped VALUES (:n)"), {"n": message.value["n"]})
            seen.append(message.value["n"])

    server = with_driver(postgres_server.url(), driver)
    with throwaway_database(server, inbox=True) as url:
        assert url.startswith(driver.scheme + "://")  # the service's own driver
        check = sa.create_engine(with_driver(url, DRIVERS[1]))
        with check.begin() as conn:
            conn.execute(sa.text("CREATE TABLE shipped (n int PRIMARY KEY)"))
        feeder = InboxFeeder(inbox, url)
        message_id = uuid.uuid4()
        try:
            assert feeder.feed("orders", {"n": 1}, message_id=message_id).applied
            assert feeder.feed("orders", {"n": 1}, message_id=message_id).duplicate
        finally:
            feeder.close()
        with check.connect() as conn:
            assert list(conn.execute(sa.text("SELECT n FROM shipped")).scalars()) == [1]
        check.dispose()
    assert seen == [1]
