"""The relay's PostgreSQL sessions: how each is opened, and the settings each needs."""

from __future__ import annotations

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from outbox.relay.config import RelayConfig

_DIALECT = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]

#: Milliseconds a mark waits for a row lock another transaction holds (an operator's UPDATE, a
#: long `outbox dead retry`) before it gives up, to try again later without waiting: a mark
#: takes milliseconds and writers lock no pending row, so a wait this long is such a
#: transaction, and the batch's other shards wait no longer than a couple of seconds for it.
MARK_LOCK_TIMEOUT_MS = 2000


def open_session(
    config: RelayConfig, name: str, *, marking: bool = False, reading: bool = False
) -> psycopg.Connection:
    """An autocommit session named ``name`` (its ``application_name``), with the relay's
    settings: a marking session plans hash joins only and waits at most
    :data:`MARK_LOCK_TIMEOUT_MS` for a row lock; the reading session plans its read once."""
    # SQLAlchemy's own reading of the URL: every host and port of a multi-host URL (and
    # target_session_attrs), as the services' engines connect.
    _, target = _DIALECT.create_connect_args(sa.make_url(config.database_url))  # type: ignore[no-untyped-call]
    given = f"{target.pop('options')} " if "options" in target else ""
    # Marks join the table to the batch's arrays: hash joins only (see
    # outbox.engines.hash_joins_only). Measured: statistics taken while few rows were pending,
    # and the pending index full of rows marked since the last vacuum, gave a nested loop
    # comparing every row with every id, 0.4-0.5 s per mark at 10,000 msgs/s.
    joins = " -c enable_nestloop=off" if marking else ""
    locks = f" -c lock_timeout={MARK_LOCK_TIMEOUT_MS}" if marking else ""
    # The reading session runs the batch read, planned once for any parameters: its plan (a
    # walk of each shard's pending index) is the same for every batch, and planning it again
    # took a read's backend 0.7 of its 1 ms when the relay keeps up. Other statements are
    # planned for their own parameters: a generic plan of a mark guesses its arrays' sizes
    # wrong (see outbox.engines.sender_engine).
    plans = "force_generic_plan" if reading else "force_custom_plan"
    target.setdefault("host", "localhost")
    return psycopg.connect(
        **target,
        autocommit=True,
        connect_timeout=10,
        keepalives=1,
        keepalives_idle=5,
        keepalives_interval=2,
        keepalives_count=3,
        application_name=name[:63],
        # No sequential scans: right after a TRUNCATE, or before autovacuum analyzes a table
        # that grew fast, the planner takes the table for a small one and scans all of it for
        # each mark (every statement of these sessions has an index to use). Marks of sent
        # rows: see RelayConfig.marks_wait_for_flush (failures always wait); set either way,
        # so that a database or role default does not decide it. The server, too, should
        # notice a vanished relay quickly: drop the owner session's locks, and not keep the
        # other sessions' backends for hours.
        options=given
        + f"-c plan_cache_mode={plans} -c jit=off -c enable_seqscan=off"
        + joins
        + locks
        + " -c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3"
        " -c synchronous_commit=" + ("on" if config.marks_wait_for_flush else "off"),
    )
