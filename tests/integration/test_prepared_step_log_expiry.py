"""The documented checker with ``--on-max-checks rollback``: checks that met the step's open
transaction (the step holds its message id: a failed check, not an UNKNOWN) must not end the
message rolled back, since the step can still commit."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.prepared import CheckRegistry, PreparedMessages
from tests import prepared_app
from tests.integration import test_prepared as base
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def orders(database_url: str) -> Iterator[sa.Engine]:
    engine = prepared_app.create_orders_table(database_url)
    yield engine
    engine.dispose()


def test_a_step_still_open_at_max_checks_is_not_rolled_back(
    engine: sa.Engine, outbox_url: str, orders: sa.Engine
) -> None:
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP, check_after=0)
    message = prepared.prepare("orders", {"type": "OrderCreated", "order_id": 600}, key=600)
    blocker = orders.connect()
    blocker.execute(sa.text("LOCK TABLE orders IN SHARE MODE"))  # what CREATE INDEX takes
    step_done = threading.Event()

    def step() -> None:  # its process then dies before commit(): check-back decides
        prepared_app.place_order(orders, 600, message.message_id)
        step_done.set()

    writer = threading.Thread(target=step, daemon=True)
    writer.start()
    # Checks begin once the step holds its message id (it waits for the table's lock): a
    # check before that finds no step and rightly ends the message rolled back.
    wait_for(lambda: prepared_app.a_step_waits_for_a_lock(orders), 30, "the step's lock wait")
    registry = CheckRegistry()
    registry.add_checker(prepared_app.order_checker(orders), prepared_app.GROUP)
    config = base.fast_config(
        outbox_url, check_timeout=10.0, max_checks=2, on_max_checks="rollback"
    )
    try:
        with base.running_checkback(registry, config):
            wait_for(lambda: base.row(engine, message.message_id)["check_count"] >= 2, 40, "2")
            blocker.rollback()  # the lock goes: the order commits, late
            writer.join(30)
            assert step_done.is_set()
            wait_for(
                lambda: base.status_of(engine, message.message_id) != "prepared", 30, "decided"
            )
    finally:
        blocker.close()
    assert prepared_app.order_exists(orders, 600)  # the step happened...
    assert base.status_of(engine, message.message_id) != "rolled_back"  # ...so no rollback
