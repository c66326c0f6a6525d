"""Every statement on scheduled messages, behind named methods (the queries are in
``outbox/sql/queries.sql``); each runs in the caller's transaction."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from typing import Any

import sqlalchemy as sa

from outbox.queries import Queries
from outbox.schema import OutboxTableSpec

#: Who cancelled a scheduled message (the ``resolved_by`` column).
PRODUCER, OPERATOR = "producer", "operator"


class ScheduledStore:
    """The statements on one outbox table's scheduled messages."""

    def __init__(self, spec: OutboxTableSpec) -> None:
        self.spec = spec
        self.queries = Queries(spec)

    def cancel(self, conn: sa.Connection, ids: Collection[uuid.UUID], by: str) -> set[uuid.UUID]:
        """Cancel the given messages that are still scheduled; returns those it cancelled."""
        if not ids:
            return set()
        params = {"ids": list(set(ids)), "by": by}
        return set(conn.execute(self.queries["cancel_scheduled"], params).scalars())

    def statuses(self, conn: sa.Connection, ids: Collection[uuid.UUID]) -> dict[uuid.UUID, str]:
        """Where the given messages stand; an id with no row is absent."""
        rows = conn.execute(self.queries["prepared_statuses"], {"ids": list(ids)})
        return {row.id: row.status for row in rows}

    def waiting(
        self,
        conn: sa.Connection,
        *,
        ids: Sequence[uuid.UUID] | None = None,
        topic: str | None = None,
        limit: int | None = None,
    ) -> list[sa.RowMapping]:
        """Scheduled messages, the soonest due first."""
        params: dict[str, Any] = {"ids": list(ids) if ids else None, "topic": topic}
        params["limit"] = limit
        return list(conn.execute(self.queries["list_scheduled"], params).mappings())
