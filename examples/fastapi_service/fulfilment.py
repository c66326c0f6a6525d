"""A second service, fulfilment, that consumes the order service's ``OrderPlaced`` messages.

It has its own database. Each message becomes a shipment row, written in the same
transaction as the inbox row that records the message as applied, so an order is shipped
once however often Kafka delivers its message (a relay's retry, a consumer's restart).

    export OUTBOX_DATABASE_URL=postgresql+psycopg://fulfilment:pw@db/fulfilment
    python -m examples.fastapi_service.fulfilment   # its shipments table (a real service:
                                                    # its own migrations)
    outbox inbox install                            # the inbox tables
    outbox consume examples.fastapi_service.fulfilment:inbox

``ORDERS_TOPIC`` names the topic (default ``orders``), as for the order service.
"""

from __future__ import annotations

import os
import uuid
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from outbox.inbox import Inbox, InboxMessage

ORDERS_TOPIC = os.environ.get("ORDERS_TOPIC", "orders")


class Base(DeclarativeBase):
    pass


class Shipment(Base):
    __tablename__ = "shipments"
    order_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    customer_id: Mapped[int]
    total: Mapped[Decimal] = mapped_column(sa.Numeric(12, 2))
    items: Mapped[int]


inbox = Inbox(group="fulfilment")


@inbox.handler(ORDERS_TOPIC)
def ship(message: InboxMessage, session: Session) -> None:
    """Apply one ``OrderPlaced``; other event types on the topic are not ours to act on."""
    event = message.value
    if event.get("type") != "OrderPlaced":
        return
    session.add(
        Shipment(
            order_id=uuid.UUID(event["order_id"]),
            customer_id=event["customer_id"],
            total=Decimal(event["total"]),  # written as a string: no float on the way
            items=sum(line["quantity"] for line in event["lines"]),
        )
    )


def create_tables(url: str) -> None:
    """The shipments table (what the service's own migrations would do)."""
    engine = sa.create_engine(url)
    try:
        Base.metadata.create_all(engine)
    finally:
        engine.dispose()


if __name__ == "__main__":
    create_tables(os.environ["OUTBOX_DATABASE_URL"])
