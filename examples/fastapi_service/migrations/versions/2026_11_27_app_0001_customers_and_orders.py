"""Customers and orders: the service's first revision, on a branch labelled ``app``.

Revision ID: app_0001
Revises:
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "app_0001"
down_revision = None
branch_labels = ("app",)
depends_on = None


def upgrade() -> None:
    op.create_table(
        "customers",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("credit", sa.Numeric(12, 2), nullable=False),
    )
    op.create_table(
        "orders",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("customer_id", sa.BigInteger, sa.ForeignKey("customers.id"), nullable=False),
        sa.Column("total", sa.Numeric(12, 2), nullable=False),
        sa.Column("lines", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("orders")
    op.drop_table("customers")
