"""The relay's marks find their rows by primary key, however stale the table's statistics.

Between two visits of autovacuum the partial pending index keeps an entry for every row marked
since the last vacuum, and statistics taken while few rows were pending make it look small. A
mark planned over that index walks all of it (or, as a nested loop, compares every row with
every id): at 10,000 msgs/s that took 0.4-0.5 s per mark and the relay fell seconds behind.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa

from outbox.engines import sender_engine
from outbox.relay.config import RelayConfig
from outbox.relay.connections import open_session
from outbox.relay.store import RelayStore
from outbox.schema import DEFAULT_SPEC

PENDING = 5_000


@pytest.fixture
def stale_table(engine: sa.Engine) -> list[uuid.UUID]:
    """An outbox analyzed while 1 row in 100 was pending, then given a backlog of
    ``PENDING`` rows and 15,000 rows marked sent since (their pending index entries stay:
    autovacuum is off for the table). Returns the ids of the pending rows."""

    def insert(count: int) -> None:
        conn.execute(
            sa.text(
                "INSERT INTO outbox (id, shard, topic, key, value) "
                "SELECT gen_random_uuid(), i % 16, 'plans', convert_to('k' || i % 97, 'UTF8'),"
                " '\\x00'::bytea FROM generate_series(1, :count) AS i"
            ),
            {"count": count},
        )

    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox SET (autovacuum_enabled = off)"))
        insert(10_000)
        conn.execute(
            sa.text("UPDATE outbox SET status = 'sent', sent_at = now() WHERE random() < 0.99")
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE outbox"))
    with engine.begin() as conn:
        insert(15_000 + PENDING)
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = 'sent', sent_at = now() WHERE id IN ("
                " SELECT id FROM outbox WHERE status = 'pending' AND topic = 'plans'"
                " ORDER BY seq LIMIT 15000)"
            )
        )
        rows = conn.execute(
            sa.text("SELECT id FROM outbox WHERE status = 'pending' ORDER BY seq LIMIT 2000")
        )
        return [row[0] for row in rows]


class Sessions:
    """The relay's store and its sessions, as the relay opens them (no relay runs)."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.store = RelayStore(
            sender_engine(config.database_url, durable=False), config.spec, "plans", False
        )

    def _open_session(self, name: str, marking: bool = False) -> psycopg.Connection:
        return open_session(self.config, name, marking=marking, reading=not marking)


@pytest.fixture
def relay(outbox_url: str) -> Iterator[Sessions]:
    yield Sessions(RelayConfig(database_url=outbox_url, kafka={"bootstrap.servers": "127.0.0.1:9"}))


def plan(session: psycopg.Connection, sql: str, params: dict[str, object]) -> str:
    return "\n".join(row[0] for row in session.execute("EXPLAIN " + sql, params).fetchall())


@pytest.mark.parametrize("statement", ["mark_sent", "delete_sent"])
def test_a_mark_on_a_marking_session_uses_the_primary_key_where_the_pending_index_looks_cheaper(
    relay: Sessions, stale_table: list[uuid.UUID], statement: str
) -> None:
    ids = stale_table
    params: dict[str, object] = {
        "ids": ids,
        "partitions": [0] * len(ids),
        "offsets": list(range(len(ids))),
        "generations": [0] * len(ids),
        "owner": None,
        "owner_key": 1,
        **DEFAULT_SPEC.owner_session_keys,
    }
    sql = relay.store._psycopg_sql(statement)  # as the relay runs it
    session = relay._open_session("plans/mark", marking=True)
    try:
        # The table is in the state that misleads the planner: with the status as a
        # constant, the same statement would take the pending index.
        constant = sql.replace("(SELECT 'pending')", "'pending'")
        assert constant != sql
        assert "outbox_pending_idx" in plan(session, constant, params)

        chosen = plan(session, sql, params)
        assert "outbox_pkey" in chosen, chosen
        assert "outbox_pending_idx" not in chosen, chosen
        assert "Nested Loop" not in chosen, chosen
    finally:
        session.close()


def test_only_the_marking_sessions_run_without_nested_loops(relay: Sessions) -> None:
    """The reads need nested loops (a lateral scan per shard); the marks must not have them."""
    marking = relay._open_session("plans/mark", marking=True)
    reading = relay._open_session("plans/read")
    try:
        assert marking.execute("SHOW enable_nestloop").fetchone() == ("off",)
        assert reading.execute("SHOW enable_nestloop").fetchone() == ("on",)
    finally:
        marking.close()
        reading.close()
