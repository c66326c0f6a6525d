"""The order service of the prepared-message tests, in the seeds' order-creation flow: the
orders live in a database of their own, the ``OrderCreated`` message is prepared in the
outbox's database, and the checker answers by the message id the order's transaction
recorded (docs/prepared-messages.md, "A checker that cannot lie").

``python -m tests.prepared_app OUTBOX_URL ORDERS_URL TOPIC ORDER_ID with-order|without-order``
prepares the message, writes the order (or not), prints ``prepared <message id>`` and waits
to be killed between that and the commit. ``outbox checkback tests.prepared_app:registry``
checks with :data:`registry`, which reads the orders database from ORDERS_DATABASE_URL.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import sqlalchemy as sa

from outbox import Outbox
from outbox.prepared import CheckMessage, CheckRegistry, PreparedMessages, StepLog

ORDERS_DDL = """
CREATE TABLE IF NOT EXISTS orders (
    id bigint PRIMARY KEY,
    total numeric NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""

#: The producer group the order service prepares its messages under.
GROUP = "order-service"
#: Which message each order's transaction happened with.
STEPS = StepLog()


def create_orders_table(orders_url: str) -> sa.Engine:
    engine = sa.create_engine(orders_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(ORDERS_DDL)
    STEPS.create(engine)
    return engine


def place_order(
    orders: sa.Engine, order_id: int, message_id: uuid.UUID, total: str = "19.90"
) -> None:
    """The business step: the order and its message id, committed in the orders database."""
    with orders.begin() as conn:
        STEPS.record(conn, message_id)
        conn.execute(
            sa.text("INSERT INTO orders (id, total) VALUES (:id, :total)"),
            {"id": order_id, "total": total},
        )


def a_step_waits_for_a_lock(orders: sa.Engine) -> bool:
    """Whether a session of the orders database waits for a lock: a :func:`place_order` that
    got there holds its message id already (it records the step first)."""
    with orders.connect() as conn:
        waiting = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar()
    return bool(waiting)


def order_exists(orders: sa.Engine, order_id: int) -> bool:
    with orders.connect() as conn:
        found = conn.execute(sa.text("SELECT 1 FROM orders WHERE id = :id"), {"id": order_id})
        return found.first() is not None


def order_checker(orders: sa.Engine):  # type: ignore[no-untyped-def]
    """``checkLocalTransaction`` of the order service: by the message id, never the order id."""

    def check(message: CheckMessage) -> str:
        return STEPS.answer(orders, message)

    return check


def _check_from_environment(message: CheckMessage) -> str:
    global _checker
    if _checker is None:
        _checker = order_checker(sa.create_engine(os.environ["ORDERS_DATABASE_URL"]))
    answer: str = _checker(message)
    return answer


_checker = None
registry = CheckRegistry()
registry.add_checker(_check_from_environment, GROUP)


def main(argv: list[str]) -> None:
    outbox_url, orders_url, topic, order_id, mode = argv
    prepared = PreparedMessages(Outbox(outbox_url), group=GROUP, check_after=0.3)
    message = prepared.prepare(
        topic, {"type": "OrderCreated", "order_id": int(order_id)}, key=int(order_id)
    )
    if mode == "with-order":
        place_order(sa.create_engine(orders_url), int(order_id), message.message_id)
    print(f"prepared {message.message_id}", flush=True)
    time.sleep(600)  # killed here: the order may be written, the message is not committed


if __name__ == "__main__":
    main(sys.argv[1:])
