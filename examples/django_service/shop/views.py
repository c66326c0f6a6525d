"""``POST /orders``: the order, its ``OrderPlaced`` message and the customer's debit in one
transaction of Django's connection. A customer without enough credit (found by the debit,
after the publish) rolls back the order and its message: 409, and nothing is sent.

    python -m examples.django_service migrate
    python -m examples.django_service runserver 8000
    outbox relay    # next to it: OUTBOX_DATABASE_URL=postgresql://... (the same database)
"""

from __future__ import annotations

import json
import os
from decimal import Decimal, InvalidOperation

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

import outbox.django
from examples.django_service.shop.models import Customer, Order

ORDERS_TOPIC = os.environ.get("ORDERS_TOPIC", "orders")


class InsufficientCredit(Exception):
    """The order would take the customer's credit below zero."""


@csrf_exempt
@require_POST
def create_customer(request: HttpRequest) -> JsonResponse:
    customer = Customer.objects.create(credit=_money(json.loads(request.body)["credit"]))
    return JsonResponse({"customer_id": customer.id}, status=201)


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    try:
        body = json.loads(request.body)
        customer_id, total = int(body["customer_id"]), _money(body["total"])
    except (ValueError, KeyError, TypeError) as exc:
        return JsonResponse({"error": f"bad request: {exc}"}, status=400)
    try:
        with transaction.atomic():
            customer = Customer.objects.select_for_update().get(id=customer_id)
            order = Order.objects.create(customer=customer, total=total)
            published = outbox.django.publish(
                ORDERS_TOPIC,
                {"type": "OrderPlaced", "order_id": order.id, "total": total},
                key=order.id,
            )
            customer.credit -= total
            if customer.credit < 0:
                raise InsufficientCredit(customer.id)  # rolls back the order and its message
            customer.save(update_fields=["credit"])
    except InsufficientCredit:
        return JsonResponse({"error": "insufficient credit"}, status=409)
    except Customer.DoesNotExist:
        return JsonResponse({"error": "no such customer"}, status=404)
    return JsonResponse(
        {"order_id": str(order.id), "message_id": str(published.message_id)}, status=201
    )


def _money(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except (InvalidOperation, TypeError):
        raise ValueError(f"not an amount: {text!r}") from None
    return value.quantize(Decimal("0.01"))
