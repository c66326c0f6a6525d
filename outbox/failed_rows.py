"""Reading failed rows for grouping by cause: the outbox's dead messages and the inbox's
parked rows, as :class:`outbox.fingerprints.FailedRow` s.

Dead rows carry no time of death: a dead message is "seen" at its ``created_at`` (when it was
written). A parked row is seen at ``parked_at``.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from outbox.fingerprints import FailedRow, exception_class

if TYPE_CHECKING:
    from outbox.inbox.schema import InboxTableSpec
    from outbox.queries import Queries


def dead_rows(conn: sa.Connection, queries: Queries, topic: str | None) -> list[FailedRow[Any]]:
    """Every dead message (of ``topic``, if given)."""
    result = conn.execute(queries["dead_errors"], {"topic": topic})
    return [
        FailedRow[uuid.UUID](
            id=row.id,
            topic=row.topic,
            kind=row.error_kind or "unknown",
            error=row.last_error,
            seen_at=row.created_at,
        )
        for row in result
    ]


def parked_rows(
    conn: sa.Connection, spec: InboxTableSpec, group: str | None, topic: str | None
) -> list[FailedRow[Any]]:
    """Every parked inbox row still waiting for an operator (not those already handed back
    for a retry), of ``group`` and ``topic`` if given. The class is the reason it was parked
    and, for a handler's failure, the exception's class (``handler/ValueError``)."""
    p = spec.parked
    statement = sa.select(p.c.id, p.c.topic, p.c.reason, p.c.error, p.c.parked_at).where(
        p.c.status == "parked"
    )
    if group is not None:
        statement = statement.where(p.c.consumer_group == group)
    if topic is not None:
        statement = statement.where(p.c.topic == topic)
    return [
        FailedRow[int](
            id=row.id,
            topic=row.topic,
            kind=f"{row.reason}/{exception_class(row.error, 'error')}",
            error=row.error,
            seen_at=row.parked_at,
        )
        for row in conn.execute(statement)
    ]
