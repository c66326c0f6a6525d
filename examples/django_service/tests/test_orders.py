"""The order service's own tests, under pytest-django: what a request published in its
transaction, and that a refused one published nothing."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from django.db import transaction
from django.test import Client

import outbox
import outbox.django
from examples.django_service.shop.models import Customer, Order
from outbox.testing import PublishedMessages


def place(client: Client, customer: int, total: str) -> int:
    body = json.dumps({"customer_id": customer, "total": total})
    return int(client.post("/orders", body, content_type="application/json").status_code)


@pytest.mark.django_db
def test_a_placed_order_publishes_order_placed_keyed_by_the_order(
    client: Client, published: PublishedMessages
) -> None:
    customer = Customer.objects.create(credit=Decimal("100.00"))
    assert place(client, customer.id, "20.00") == 201

    message = published.one("orders")
    order = Order.objects.get()
    assert message.value == {"type": "OrderPlaced", "order_id": str(order.id), "total": "20.00"}
    assert message.key == str(order.id).encode()


@pytest.mark.django_db
def test_a_refused_order_publishes_nothing(client: Client, published: PublishedMessages) -> None:
    customer = Customer.objects.create(credit=Decimal("15.00"))
    assert place(client, customer.id, "20.00") == 409
    published.assert_none()
    assert not Order.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_message_commits_with_the_order_and_rolls_back_with_it(
    published: PublishedMessages,
) -> None:
    customer = Customer.objects.create(credit=Decimal("10.00"))
    with transaction.atomic():
        outbox.django.publish("orders", {"n": 1}, key=customer.id)
    with pytest.raises(RuntimeError), transaction.atomic():
        outbox.django.publish("orders", {"n": 2}, key=customer.id)
        raise RuntimeError("the business step failed")
    assert published.values("orders") == [{"n": 1}]


@pytest.mark.django_db(transaction=True)
def test_publish_outside_atomic_is_refused() -> None:
    with pytest.raises(outbox.NotInTransaction, match="atomic"):
        outbox.django.publish("orders", {"n": 1})


@pytest.mark.django_db
def test_an_idempotency_key_publishes_once(published: PublishedMessages) -> None:
    with transaction.atomic():
        first = outbox.django.publish("orders", {"n": 1}, idempotency_key="order-7")
        again = outbox.django.publish("orders", {"n": 1}, idempotency_key="order-7")
    assert again.duplicate and again.message_id == first.message_id
    assert published.values("orders") == [{"n": 1}]


@pytest.mark.django_db
def test_a_scheduled_message_is_cancelled_in_the_same_transaction(
    published: PublishedMessages,
) -> None:
    from outbox.scheduled.api import ScheduledMessages

    with transaction.atomic():
        reminder = outbox.django.publish("reminders", {"n": 1}, deliver_after=3600)
        with outbox.django.connection() as conn:
            ScheduledMessages(outbox.Outbox()).cancel(reminder.message_id, bind=conn)
    assert published.one("reminders").status == "cancelled"
