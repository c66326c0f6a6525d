"""The demo's consuming service: billing turns each OrderPlaced message into a ledger entry.

It runs as `outbox consume examples.billing:inbox` against its own database, whose
``ledger`` table examples/demo.py creates. The ledger
entry and the inbox row commit in one transaction, so an order is billed once however often
Kafka delivers its message.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox.inbox import Inbox, InboxMessage

inbox = Inbox(group="billing")


@inbox.handler("orders")
def bill(message: InboxMessage, session: Session) -> None:
    order = message.value
    session.execute(
        sa.text("INSERT INTO ledger VALUES (:order_id, :customer, :amount)"),
        {
            "order_id": order["order_id"],
            "customer": order["customer"],
            "amount": order["total_cents"],
        },
    )
