"""The order service's own tests, with the outbox's test helpers: what a request published (and
that a refused one published nothing), and the fulfilment handler fed without Kafka.

    OUTBOX_TEST_DATABASE_URL=postgresql+psycopg://postgres:pw@127.0.0.1:5432/postgres \\
        pytest examples/fastapi_service
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

import outbox
from examples.fastapi_service import app as service
from examples.fastapi_service import fulfilment
from outbox.testing import InboxFeeder, PublishedMessages


class Client:
    """Requests to the app in this process (httpx's ASGI transport), each on its own loop."""

    def post(self, path: str, json: dict[str, Any]) -> httpx.Response:
        async def send() -> httpx.Response:
            transport = httpx.ASGITransport(app=service.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://orders") as client:
                return await client.post(path, json=json)

        return asyncio.run(send())


@pytest.fixture
def client(outbox_database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    """The service on a database of the test's own (its tables; the outbox's are there)."""
    # No pool: each request runs on an event loop of its own.
    async_engine = create_async_engine(outbox_database_url, poolclass=NullPool)
    monkeypatch.setattr(service, "ob", outbox.Outbox(async_engine))
    yield Client()
    asyncio.run(async_engine.dispose())


def place(client: Client, customer: int, quantity: int) -> int:
    line = {"sku": "SKU-1", "quantity": quantity, "unit_price": "10.00"}
    return client.post("/orders", {"customer_id": customer, "lines": [line]}).status_code


def test_a_placed_order_publishes_order_placed_keyed_by_the_order(
    client: Client, published: PublishedMessages
) -> None:
    customer = client.post("/customers", {"credit": "100.00"}).json()["customer_id"]
    assert place(client, customer, quantity=2) == 201

    message = published.one("orders")
    assert message.value["type"] == "OrderPlaced"
    assert message.value["total"] == "20.00"  # a decimal arrives as a string
    assert message.key == message.value["order_id"].encode()


def test_a_refused_order_publishes_nothing(client: Client, published: PublishedMessages) -> None:
    customer = client.post("/customers", {"credit": "15.00"}).json()["customer_id"]
    assert place(client, customer, quantity=2) == 409  # the debit after the publish failed
    published.assert_none()


def test_fulfilment_ships_an_order_once_however_often_it_arrives(
    fulfilment_database_url: str,
) -> None:
    feeder = InboxFeeder(fulfilment.inbox, fulfilment_database_url)  # its own database
    order_id, message_id = uuid.uuid4(), uuid.uuid4()
    event = {
        "type": "OrderPlaced",
        "order_id": str(order_id),
        "customer_id": 7,
        "total": "20.00",
        "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price": "10.00"}],
    }

    first = feeder.feed("orders", event, key=str(order_id), message_id=message_id)
    again = feeder.feed("orders", event, key=str(order_id), message_id=message_id)
    feeder.close()

    assert first.applied and again.duplicate
    engine = sa.create_engine(fulfilment_database_url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT order_id, items FROM shipments")).all() == [
            (order_id, 2)
        ]
    engine.dispose()


def test_what_the_order_service_published_ships_in_the_fulfilment_service(
    client: Client, published: PublishedMessages, fulfilment_database_url: str
) -> None:
    customer = client.post("/customers", {"credit": "100.00"}).json()["customer_id"]
    assert place(client, customer, quantity=3) == 201
    feeder = InboxFeeder(fulfilment.inbox, fulfilment_database_url)
    assert feeder.feed_published(published.one("orders")).applied
    feeder.close()
    engine = sa.create_engine(fulfilment_database_url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT items FROM shipments")).scalars().all() == [3]
    engine.dispose()
