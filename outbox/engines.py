"""Engines for the senders (relay and immediate send)."""

from __future__ import annotations

import sqlalchemy as sa


def sender_engine(url: str | sa.URL, pool_size: int = 2, *, nested_loops: bool = True) -> sa.Engine:
    """An engine for the relay's and the immediate sender's batch queries.

    Their ``= ANY(:ids)`` and ``unnest(...)`` parameters are arrays of a size only the
    actual values tell; a generic plan (what PostgreSQL switches prepared statements to after
    five runs) guesses wrong and turns a 20 ms UPDATE into a nested loop of seconds. So every
    statement is planned for its own parameters.

    JIT compilation is off: the per-row index probes of the order checks make their cost
    estimates look large, and compiling them takes longer (tens of milliseconds) than they run.

    Their commits do not wait for the WAL flush (``synchronous_commit=off``): a lease or a
    mark that a database crash forgets (at most about 0.6 s of them) only means a row is sent
    again, a duplicate that at-least-once allows and that exactly-once recovers from its
    progress records. The next message's wait for a disk flush, tens of milliseconds on a
    slow disk, matters more.

    No pre-ping: it costs a round trip per checkout, and both senders already treat a lost
    connection as an error to retry (SQLAlchemy then drops the pool's stale connections).

    ``nested_loops=False`` makes an engine for the marking statements: see
    :func:`hash_joins_only`, here for every statement of the session.
    """
    options = "-c plan_cache_mode=force_custom_plan -c jit=off -c synchronous_commit=off"
    if not nested_loops:
        options += " -c enable_nestloop=off"
    return sa.create_engine(url, pool_size=pool_size, connect_args={"options": options})


def hash_joins_only(conn: sa.Connection) -> None:
    """Keep this transaction's marking UPDATEs off nested loops.

    They join the table to ``unnest(...)`` of the batch's ids. Statistics see ``lease_owner``
    as nearly always NULL, so the planner expects one leased row, loops over the batch once
    per row, and a 2,000-row batch takes a second instead of 30 ms.
    """
    conn.execute(sa.text("SET LOCAL enable_nestloop = off"))
