"""The documented checker cannot lie, on the real PostgreSQL: it answers by the message id the
step recorded, never rolls back a step that can still commit (one waiting on a lock), never
commits a retried step that failed on its business key, and a step that comes after its
message was abandoned cannot happen. How the step is bounded, and what a late step sees."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta

import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.prepared import (
    COMMIT,
    ROLLBACK,
    UNKNOWN,
    CheckRegistry,
    PreparedMessages,
    StepAbandoned,
    bound_step,
)
from tests import prepared_app
from tests.integration import test_prepared as base
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def orders(database_url: str) -> Iterator[sa.Engine]:
    engine = prepared_app.create_orders_table(database_url)
    yield engine
    engine.dispose()


def order_registry(orders: sa.Engine) -> CheckRegistry:
    registry = CheckRegistry()
    registry.add_checker(prepared_app.order_checker(orders), prepared_app.GROUP)
    return registry


def checked_config(outbox_url: str) -> base.CheckbackConfig:
    # The checker waits up to 2 s for a step's open transaction: the check timeout is longer.
    return base.fast_config(outbox_url, check_timeout=10.0)


def order_message(order_id: int) -> Message:
    return Message("orders", {"type": "OrderCreated", "order_id": order_id}, key=order_id)


def test_a_step_waiting_on_a_lock_is_not_rolled_back_under_it(engine, outbox_url, orders) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP, check_after=0)
    message = prepared.prepare("orders", {"type": "OrderCreated", "order_id": 500}, key=500)
    blocker = orders.connect()
    blocker.execute(sa.text("LOCK TABLE orders IN SHARE MODE"))  # what CREATE INDEX takes
    step_done = threading.Event()

    def step() -> None:  # its process then dies before commit(): check-back decides
        prepared_app.place_order(orders, 500, message.message_id)
        step_done.set()

    writer = threading.Thread(target=step, daemon=True)
    writer.start()
    # Checks begin once the step holds its message id (it waits for the table's lock): a
    # check before that finds no step and rightly ends the message rolled back.
    wait_for(lambda: prepared_app.a_step_waits_for_a_lock(orders), 30, "the step's lock wait")
    try:
        with base.running_checkback(order_registry(orders), checked_config(outbox_url)):
            # Longer than "the longest an order may take" by any fixed guess: checked again
            # after three seconds, it is still not rolled back.
            time.sleep(3)
            checks = base.row(engine, message.message_id)["check_count"]
            wait_for(
                lambda: base.row(engine, message.message_id)["check_count"] > checks, 30, "more"
            )
            stored = base.row(engine, message.message_id)
            # The step has not committed and still can: a failed check (never an UNKNOWN that
            # --on-max-checks rollback could end rolled back), and still prepared.
            assert (stored["status"], stored["last_check_answer"]) == ("prepared", "error")
            assert not step_done.is_set()
            blocker.rollback()  # the lock goes: the order commits, late
            writer.join(30)
            assert step_done.is_set()
            wait_for(lambda: base.status_of(engine, message.message_id) == "pending", 30, "ok")
    finally:
        blocker.close()
    assert prepared_app.order_exists(orders, 500)
    assert base.row(engine, message.message_id)["resolved_by"] == "check"


def test_a_retried_step_that_failed_on_its_business_key_is_rolled_back(
    engine, outbox_url, orders
) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP, check_after=0)

    def place_order(order_id: int):  # type: ignore[no-untyped-def]
        def local(message_id: uuid.UUID) -> str:
            prepared_app.place_order(orders, order_id, message_id)
            return COMMIT

        return prepared.send_in_transaction(order_message(order_id), local)

    first = place_order(300)
    assert first.resolved and first.answer is COMMIT
    # Retried without an idempotency key: the order exists, the retry's step fails on it.
    with pytest.raises(sa.exc.IntegrityError):
        place_order(300)
    with engine.connect() as conn:
        retry = conn.execute(
            sa.text("SELECT id FROM outbox WHERE status = 'prepared'")
        ).scalar_one()
    with base.running_checkback(order_registry(orders), checked_config(outbox_url)):
        wait_for(lambda: base.status_of(engine, retry) == "rolled_back", 30, "rolled back")
    with engine.connect() as conn:
        committed = conn.execute(
            sa.text("SELECT id FROM outbox WHERE status IN ('pending', 'sent')")
        ).scalars()
        assert list(committed) == [first.message_id]  # one OrderCreated for order 300


def test_a_step_after_its_message_was_abandoned_cannot_happen(engine, outbox_url, orders) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP, check_after=0)
    message = prepared.prepare("orders", {"type": "OrderCreated", "order_id": 600}, key=600)
    with base.running_checkback(order_registry(orders), checked_config(outbox_url)):
        wait_for(lambda: base.status_of(engine, message.message_id) == "rolled_back", 30, "rb")
    # The step was paused past its check (a long GC, a stopped VM) and now goes on.
    with pytest.raises(StepAbandoned) as abandoned:
        prepared_app.place_order(orders, 600, message.message_id)
    assert abandoned.value.message_id == message.message_id
    assert not prepared_app.order_exists(orders, 600)  # its transaction rolled back


def test_answers_by_message_id_before_and_after_abandon_after(engine, orders) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP)
    placed = prepared.prepare("orders", {"order_id": 1})
    prepared_app.place_order(orders, 1, placed.message_id)
    unplaced = prepared.prepare("orders", {"order_id": 2})
    registry = CheckRegistry()
    registry.add_checker(lambda m: UNKNOWN, prepared_app.GROUP)

    def message(message_id: uuid.UUID, age: float):  # type: ignore[no-untyped-def]
        row = base.row(engine, message_id)
        claimed = {**row, "age_seconds": age}
        return registry.message(claimed)

    steps = prepared_app.STEPS
    young, old = timedelta(seconds=1), timedelta(minutes=5)
    assert steps.answer(orders, message(placed.message_id, 1), abandon_after=old) is COMMIT
    assert steps.answer(orders, message(unplaced.message_id, 1), abandon_after=old) is UNKNOWN
    assert steps.answer(orders, message(unplaced.message_id, 600), abandon_after=young) is ROLLBACK
    # Asked again, the same answers (an abandoned id stays abandoned).
    assert steps.answer(orders, message(unplaced.message_id, 600)) is ROLLBACK
    assert steps.answer(orders, message(placed.message_id, 600)) is COMMIT
    # A check that must decide (the last under --on-max-checks rollback, an operator's
    # rollback) abandons a young message all the same, and the step can no longer happen.
    young_one = prepared.prepare("orders", {"order_id": 3})
    decide = registry.message(
        {**base.row(engine, young_one.message_id), "age_seconds": 1}, final=True
    )
    assert steps.answer(orders, decide, abandon_after=old) is ROLLBACK
    with pytest.raises(StepAbandoned):
        prepared_app.place_order(orders, 3, young_one.message_id)
    placed_young = message(placed.message_id, 1)
    assert steps.answer(orders, replace(placed_young, final=True), abandon_after=old) is COMMIT


def test_a_bounded_step_fails_at_its_limit_instead_of_committing_late(
    engine, outbox_url, orders
) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP, check_after=0)
    message = prepared.prepare("orders", {"type": "OrderCreated", "order_id": 700}, key=700)
    blocker = orders.connect()
    blocker.execute(sa.text("LOCK TABLE orders IN SHARE MODE"))
    started = time.monotonic()
    try:
        # The lock wait ends at the bound (the statement's or the lock's, whichever fires).
        with (
            pytest.raises(sa.exc.OperationalError, match=r"(statement|lock) timeout"),
            orders.begin() as conn,
        ):
            bound_step(conn, timedelta(milliseconds=300))
            prepared_app.STEPS.record(conn, message.message_id)
            conn.execute(sa.text("INSERT INTO orders (id, total) VALUES (700, 1)"))
        took = time.monotonic() - started
    finally:
        blocker.close()
    assert took < 5.0, took  # failed at its bound, not after the lock's holder let go
    # Nothing of the step committed: the checker answers ROLLBACK at once.
    with base.running_checkback(order_registry(orders), checked_config(outbox_url)):
        wait_for(lambda: base.status_of(engine, message.message_id) == "rolled_back", 30, "rb")
    assert not prepared_app.order_exists(orders, 700)
    with pytest.raises(StepAbandoned):  # and a retry of the step with it cannot happen
        prepared_app.place_order(orders, 700, message.message_id)
