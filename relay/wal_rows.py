"""What the WAL source reads beside the stream: decoded inserts as the rows the core sends,
the table's statements, and the rows a lost slot had not confirmed."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from outbox.queries import Queries
from outbox.records import OutboxRecord
from outbox.rows import UNDECODABLE, PendingRow, pending_row_of
from outbox.schema import DEFAULT_SPEC, OutboxTableSpec
from outbox.wal.pgoutput import WalMessage

#: ``age()`` compares 32-bit transaction ids: a horizon further back than this finds nothing
#: reliably, and every pending row is taken instead.
HORIZON_REACH = 2_000_000_000


def pending_row_of_message(message: WalMessage) -> PendingRow:
    """A decoded insert as the row the core sends (undecodable headers: a row that goes dead)."""
    created_at = datetime.fromtimestamp(message.created_at, UTC)
    names: Any = message.header_names  # a NULL name is refused by from_columns
    try:
        record: OutboxRecord | None = OutboxRecord.from_columns(
            message.id,
            message.seq,
            message.shard,
            message.topic,
            message.key,
            message.value,
            message.content_type,
            names,
            message.header_values,
            0,
        )
        problem = None
    except (ValueError, TypeError, UnicodeError) as error:
        record, problem = None, f"{UNDECODABLE}: {error}"
    return PendingRow(message.id, message.shard, 0, created_at, record, problem)


def unsettled_rows(
    conn: psycopg.Connection[Any], horizon: int | None, spec: OutboxTableSpec = DEFAULT_SPEC
) -> list[PendingRow]:
    """After a lost slot: the pending rows written (or last changed) by transactions at least
    as new as ``horizon`` (None: every pending row), by shard in seq order. They hold every
    message committed after the position recorded with ``horizon`` (:class:`Settled`), and
    also those of the transactions that ran across the snapshot it came from and committed
    before: duplicates, which at-least-once allows."""
    found = conn.execute(
        WalStatements(spec)["wal_unsettled"], {"horizon": horizon, "reach": HORIZON_REACH}
    )
    return [pending_row_of(values) for values in found]


class WalStatements:
    """The source's named queries (``outbox/sql/queries.sql``) as psycopg's own SQL."""

    def __init__(self, spec: OutboxTableSpec) -> None:
        self._queries = Queries(spec)
        self._compiled: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        compiled = self._compiled.get(name)
        if compiled is None:
            dialect = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]
            compiled = self._compiled[name] = str(self._queries[name].compile(dialect=dialect))
        return compiled
