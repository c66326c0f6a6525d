"""Database URLs, and engines for the senders (relay and immediate send).

Publishing runs on whatever SQLAlchemy PostgreSQL driver the service uses (psycopg 3,
psycopg2, asyncpg): it writes in the caller's transaction. What outbox connects itself
(the daemons, the immediate sender, the test helpers' reads) uses psycopg 3, which it
installs: the daemons use psycopg's own connections (LISTEN/NOTIFY, its errors).
"""

from __future__ import annotations

import sqlalchemy as sa

from outbox.errors import ConfigError
from outbox.redaction import mask_secrets

#: The driver outbox talks to PostgreSQL with (psycopg 3), as SQLAlchemy names it.
DRIVER_SCHEME = "postgresql+psycopg"

#: Schemes that mean PostgreSQL without naming a driver: most services' URLs (and the
#: ``DATABASE_URL`` of many hosting platforms) have one. SQLAlchemy reads ``postgresql://``
#: as psycopg2 and does not know ``postgres://`` at all.
_PLAIN_SCHEMES = ("postgres", "postgresql")


def database_url(url: str) -> str:
    """``url`` for the ``outbox`` commands, which talk to PostgreSQL with psycopg 3:
    ``postgres://`` and ``postgresql://`` become ``postgresql+psycopg://``; a URL of another
    driver is returned as it is unless it names a PostgreSQL driver.

    Raises :class:`~outbox.errors.ConfigError` for a URL with another PostgreSQL driver
    (``postgresql+psycopg2://``, ``postgresql+asyncpg://``...), saying what to write instead:
    the daemons use psycopg 3 itself (LISTEN/NOTIFY, its errors), not through SQLAlchemy,
    while publishing works with any of them (docs/publishing.md)::

        >>> database_url("postgres://app:pw@db/shop")
        'postgresql+psycopg://app:pw@db/shop'
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url
    backend, _, driver = scheme.lower().partition("+")
    if backend not in _PLAIN_SCHEMES:
        return url
    if driver in ("", "psycopg"):
        return f"{DRIVER_SCHEME}://{rest}"
    raise ConfigError(
        f"{scheme}:// works for publishing from your code, but the outbox commands talk to "
        "PostgreSQL with psycopg 3 (installed with outbox): write "
        f"{mask_secrets(DRIVER_SCHEME + '://' + rest)} instead (or postgresql://...)"
    )


def own_driver_url(url: str | sa.URL) -> sa.URL:
    """The same database as ``url``, reached with psycopg 3: for the connections outbox opens
    itself (the immediate sender's, a test helper's reads) next to a service that runs
    psycopg2 or asyncpg. A URL of another database is returned as it is."""
    parsed = sa.make_url(url) if isinstance(url, str) else url
    backend, _, driver = parsed.drivername.lower().partition("+")
    if backend in _PLAIN_SCHEMES and driver != "psycopg":
        parsed = parsed.set(drivername=DRIVER_SCHEME)
    return parsed


def sender_engine(
    url: str | sa.URL,
    pool_size: int = 2,
    *,
    nested_loops: bool = True,
    durable: bool = True,
) -> sa.Engine:
    """An engine for the relay's and the immediate sender's batch queries.

    Their ``= ANY(:ids)`` and ``unnest(...)`` parameters are arrays of a size only the
    actual values tell; a generic plan (what PostgreSQL switches prepared statements to after
    five runs) guesses wrong and turns a 20 ms UPDATE into a nested loop of seconds. So every
    statement is planned for its own parameters.

    JIT compilation is off: the per-row index probes of the order checks make their cost
    estimates look large, and compiling them takes longer (tens of milliseconds) than they run.

    ``nested_loops=False`` makes an engine for the marking statements: see
    :func:`hash_joins_only`, here for every statement of the session. They find their rows by
    primary key, so sequential scans are off too: a table that grew fast since it was last
    analyzed (or was truncated) looks small to the planner, which would then scan all of it
    for each batch.

    ``durable=False`` lets commits skip the wait for the WAL flush: the relay's engine, which
    commits nothing a crash may not forget (its marks run on its own session, see
    ``RelayConfig.marks_wait_for_flush``). The marking engines stay durable: exactly-once
    recovery can restore only a shard's last batch from Kafka's progress records, and a
    forgotten mark of any earlier batch would send its rows again.

    Every checkout pings the connection first: after a database restart, a stale pooled
    connection is replaced rather than failing the statement.
    """
    url = own_driver_url(url)
    options = "-c plan_cache_mode=force_custom_plan -c jit=off"
    if not nested_loops:
        options += " -c enable_nestloop=off -c enable_seqscan=off"
    # Set either way: a database or role default of "off" must not make marks forgettable.
    options += " -c synchronous_commit=" + ("on" if durable else "off")
    return sa.create_engine(
        url, pool_size=pool_size, pool_pre_ping=True, connect_args={"options": options}
    )


def hash_joins_only(conn: sa.Connection) -> None:
    """Keep this transaction's marking UPDATEs off nested loops.

    They join the table to ``unnest(...)`` of the batch's ids. Statistics see ``lease_owner``
    as nearly always NULL, so the planner expects one leased row, loops over the batch once
    per row, and a 2,000-row batch takes a second instead of 30 ms.
    """
    conn.execute(sa.text("SET LOCAL enable_nestloop = off"))
