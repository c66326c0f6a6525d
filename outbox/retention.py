"""Deleting sent rows once they are old enough, in short batches."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from outbox.errors import ConfigError
from outbox.queries import Queries
from outbox.schema import OutboxTableSpec


def uuid7_floor(moment: datetime) -> uuid.UUID:
    """The smallest UUIDv7 of ``moment``'s millisecond: every id made before it sorts lower."""
    millis = int(moment.timestamp() * 1000)
    return uuid.UUID(int=(millis << 80) | (0x7 << 76) | (0b10 << 62))


def purge_sent(
    engine: sa.Engine,
    older_than: timedelta,
    *,
    spec: OutboxTableSpec | None = None,
    batch_size: int = 1000,
    pause_seconds: float = 0.0,
    now: datetime | None = None,
) -> int:
    """Delete sent rows that were created and sent more than ``older_than`` ago.

    Each batch of at most ``batch_size`` rows is its own short transaction (rows locked by a
    sender are skipped), so the table is never locked for long. Returns the number deleted.
    Keep sent rows at least until the reconciliation job has audited their window.
    """
    if older_than < timedelta(0):
        raise ConfigError("older_than must not be negative")
    if batch_size <= 0:
        raise ConfigError("batch_size must be positive")
    cutoff = (now or datetime.now(UTC)) - older_than
    query = Queries(spec or OutboxTableSpec())["purge_sent"]
    params = {"cutoff": cutoff, "cutoff_id": uuid7_floor(cutoff), "batch_size": batch_size}
    total = 0
    while True:
        with engine.begin() as conn:
            deleted = conn.execute(query, params).rowcount
        total += deleted
        if deleted < batch_size:
            return total
        if pause_seconds:
            time.sleep(pause_seconds)
