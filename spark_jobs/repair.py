"""Repair: put the messages a reconciliation found missing back to pending."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator

import sqlalchemy as sa

from outbox.queries import Queries
from outbox.schema import OutboxTableSpec
from outbox.wake import wake_relays


def _batches(ids: Iterable[str], size: int) -> Iterator[list[uuid.UUID]]:
    batch: list[uuid.UUID] = []
    for value in ids:
        batch.append(uuid.UUID(value))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def requeue_missing(
    engine: sa.Engine, spec: OutboxTableSpec, ids: Iterable[str], batch_size: int = 5000
) -> int:
    """Set the given sent rows back to pending; returns how many changed.

    Only rows still marked sent change, so a second run (or one racing the relay after it
    already republished them) changes nothing more. Each batch commits on its own: a repair cut
    short keeps what it did and can simply be run again.
    """
    queries = Queries(spec)
    query = queries["requeue_missing"]
    changed = 0
    for batch in _batches(ids, batch_size):
        with engine.begin() as conn:
            requeued = conn.execute(query, {"ids": batch}).rowcount
            if requeued:
                wake_relays(conn, queries)  # pending again: a sleeping relay sends them now
            changed += requeued
    return changed
