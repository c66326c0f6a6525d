"""The order service's tables: customers with a credit, and their orders."""

from __future__ import annotations

import uuid

from django.db import models


class Customer(models.Model):
    credit = models.DecimalField(max_digits=12, decimal_places=2)


class Order(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4)
    customer = models.ForeignKey(Customer, on_delete=models.PROTECT)
    total = models.DecimalField(max_digits=12, decimal_places=2)
