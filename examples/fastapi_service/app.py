"""An order service on FastAPI and async SQLAlchemy that publishes its events through the outbox.

``POST /orders`` validates the request (pydantic), then in **one** database transaction
inserts the order, publishes an ``OrderPlaced`` message and debits the customer's credit.
Whatever fails inside that transaction (a customer without enough credit, found only by the
debit that comes after the publish, or any other exception) rolls back the order *and* the
message: no event is ever sent for an order that was not saved. A request that fails
validation never opens a transaction.

Run it from a checkout of this repository; its tables and the outbox table come from one
Alembic history (``alembic.ini`` beside this file, docs/guide-existing-service.md)::

    pip install ".[examples]"
    export OUTBOX_DATABASE_URL=postgresql+psycopg://app:pw@db/shop
    alembic -c examples/fastapi_service/alembic.ini upgrade heads
    uvicorn examples.fastapi_service.app:app --port 8000
    outbox relay    # next to it: publishes the messages to Kafka

    curl -s localhost:8000/customers -H 'content-type: application/json' \
        -d '{"credit": "100.00"}'
    curl -s localhost:8000/orders -H 'content-type: application/json' \
        -d '{"customer_id": 1, "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price": "9.90"}]}'

``ORDERS_TOPIC`` names the topic (default ``orders``). examples/fastapi_service/fulfilment.py
is a second service that consumes the messages through an inbox.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from typing import Annotated

from fastapi import FastAPI, HTTPException, status
from pydantic import BaseModel, Field

import outbox
from examples.fastapi_service.models import Customer, Order

ORDERS_TOPIC = os.environ.get("ORDERS_TOPIC", "orders")

#: The module-level outbox: reads OUTBOX_DATABASE_URL, makes its AsyncEngine on first use.
ob = outbox.Outbox()


# -- requests and responses ----------------------------------------------------------------------

Money = Annotated[Decimal, Field(gt=0, max_digits=10, decimal_places=2)]


class OrderLine(BaseModel):
    sku: str = Field(min_length=1, max_length=64, pattern=r"^[A-Z0-9-]+$")
    quantity: int = Field(gt=0, le=1000)
    unit_price: Money


class PlaceOrder(BaseModel):
    customer_id: int = Field(gt=0)
    lines: list[OrderLine] = Field(min_length=1, max_length=100)


class OrderPlaced(BaseModel):
    order_id: uuid.UUID
    message_id: uuid.UUID
    total: Decimal


class NewCustomer(BaseModel):
    credit: Money


class CustomerCreated(BaseModel):
    customer_id: int


class InsufficientCredit(Exception):
    """The order would take the customer's credit below zero."""


# -- the app -------------------------------------------------------------------------------------


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    yield
    await ob.async_engine.dispose()


app = FastAPI(title="orders", lifespan=lifespan)


@app.post("/customers", status_code=status.HTTP_201_CREATED)
async def create_customer(request: NewCustomer) -> CustomerCreated:
    async with ob.atransaction() as tx:
        customer = Customer(credit=request.credit)
        tx.session.add(customer)
        await tx.session.flush()
        return CustomerCreated(customer_id=customer.id)


@app.post("/orders", status_code=status.HTTP_201_CREATED)
async def place_order(request: PlaceOrder) -> OrderPlaced:
    total = sum((line.unit_price * line.quantity for line in request.lines), Decimal(0))
    order = Order(
        id=uuid.uuid4(), customer_id=request.customer_id, total=total, lines=len(request.lines)
    )
    try:
        async with ob.atransaction() as tx:
            # Locked until commit: concurrent orders of one customer debit one after another.
            customer = await tx.session.get(Customer, order.customer_id, with_for_update=True)
            if customer is None:
                raise LookupError(order.customer_id)
            tx.session.add(order)
            published = await tx.publish(
                ORDERS_TOPIC,
                {
                    "type": "OrderPlaced",
                    "order_id": order.id,
                    "customer_id": order.customer_id,
                    "total": total,  # a string in JSON: decimals never become floats
                    "lines": [line.model_dump() for line in request.lines],
                },
                key=order.id,  # the order's later events keep their order behind this one
            )
            # The debit comes after the publish: raising here rolls the message back too.
            customer.credit -= total
            if customer.credit < 0:
                raise InsufficientCredit(customer.id)
    except LookupError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no such customer") from None
    except InsufficientCredit:
        raise HTTPException(status.HTTP_409_CONFLICT, "not enough credit") from None
    return OrderPlaced(order_id=order.id, message_id=published.message_id, total=total)
