"""The order service's tables, as its Alembic history creates them (migrations/versions)."""

from __future__ import annotations

import uuid
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Customer(Base):
    __tablename__ = "customers"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    credit: Mapped[Decimal] = mapped_column(sa.Numeric(12, 2))


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    customer_id: Mapped[int] = mapped_column(sa.ForeignKey("customers.id"))
    total: Mapped[Decimal] = mapped_column(sa.Numeric(12, 2))
    lines: Mapped[int]
