"""Deleting sent rows (and rolled-back prepared messages) once they are old enough, in short
batches. Prepared messages still waiting for a verdict are never deleted.

Purged rows can no longer be checked against the topics: a reconciliation that still reads
their time would report their records as phantoms. :func:`audit_horizon` says how far back the
default nightly audit reads, and ``outbox purge`` refuses a cut-off later than that unless told
otherwise.
"""

from __future__ import annotations

import math
import time
import uuid
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from outbox.errors import ConfigError
from outbox.queries import Queries
from outbox.schema import CANCELLED, ROLLED_BACK, SENT, OutboxTableSpec

#: The slack the nightly reconciliation reads at each edge of the day it audits (the
#: ``--grace`` default of ``outbox reconcile``, ``AuditWindow.grace``): rows
#: made up to this long before the audited day are still read, so they must still be there.
AUDIT_GRACE = timedelta(minutes=15)


def audit_horizon(now: datetime) -> datetime:
    """The earliest moment the default nightly reconciliation may still read at ``now``.

    It audits the previous UTC day, reading :data:`AUDIT_GRACE` before its start. Rows made
    after this moment may not have been audited yet (the audit of yesterday may still be to
    run), so a purge should not reach past it.
    """
    today = datetime.combine(now.astimezone(UTC).date(), datetime.min.time(), tzinfo=UTC)
    return today - timedelta(days=1) - AUDIT_GRACE


def audit_refusal(now: datetime, cutoff: datetime) -> str | None:
    """Why removing rows up to ``cutoff`` could take rows the nightly audit still reads, or
    None (what ``outbox purge`` and ``outbox partitions maintain`` refuse)."""
    horizon = audit_horizon(now)
    if cutoff <= horizon:
        return None
    hours = math.ceil((now - horizon).total_seconds() / 3600)
    grace = int(AUDIT_GRACE.total_seconds() // 60)
    return (
        f"refusing to purge up to {cutoff:%Y-%m-%d %H:%M} UTC: the nightly reconciliation "
        f"still reads rows made since {horizon:%Y-%m-%d %H:%M} UTC (the previous UTC day, "
        f"with {grace} minutes of grace) and would report their records as phantoms. "
        f"Use --older-than {hours}h or more, or pass --ignore-audit-window if no audit "
        "will read them"
    )


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
    dry_run: bool = False,
) -> int:
    """Delete sent rows that were created and sent more than ``older_than`` ago, and prepared
    messages rolled back (scheduled ones cancelled) that long ago (they were never published).
    Prepared messages waiting for a verdict and scheduled ones waiting for their time are
    never deleted.

    Each batch of at most ``batch_size`` rows is its own short transaction (rows locked by a
    sender are skipped), so the table is never locked for long. Returns the number deleted;
    with ``dry_run``, deletes nothing and returns how many rows qualify.
    Keep sent rows at least until the reconciliation job has audited their window
    (see :func:`audit_horizon`).
    """
    if older_than < timedelta(0):
        raise ConfigError("older_than must not be negative")
    if batch_size <= 0:
        raise ConfigError("batch_size must be positive")
    spec = spec or OutboxTableSpec()
    cutoff = (now or datetime.now(UTC)) - older_than
    if dry_run:
        return count_purgeable(engine, cutoff, spec=spec)
    query = Queries(spec)["purge_sent"]
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


def count_purgeable(
    engine: sa.Engine, cutoff: datetime, *, spec: OutboxTableSpec | None = None
) -> int:
    """How many rows a purge up to ``cutoff`` would take: sent rows created and sent before
    it, and rolled-back (cancelled) ones created and rolled back (cancelled) before it."""
    table = (spec or OutboxTableSpec()).table_obj
    # The same conditions as the purge_sent query; the id bound lets the primary key serve it.
    query = (
        sa.select(sa.func.count())
        .select_from(table)
        .where(
            table.c.id < uuid7_floor(cutoff),
            sa.or_(
                sa.and_(table.c.status == SENT, table.c.sent_at < cutoff),
                sa.and_(table.c.status.in_([ROLLED_BACK, CANCELLED]), table.c.resolved_at < cutoff),
            ),
        )
    )
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())
