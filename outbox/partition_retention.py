"""Retention on the partitioned layout: whole partitions go, not rows.

``maintain`` makes the ranges of the coming periods ahead of time, then takes each range
partition that ended before the cut-off: when every row in it is done (sent, or rolled back
or cancelled, before the cut-off: the rule of :func:`outbox.retention.purge_sent`) it is
dropped (or detached, to archive). A partition still holding a row that is not done (pending,
dead, prepared, scheduled, or sent after the cut-off) is kept, or with ``carry`` its rows that
are not done move, with their ids and ``seq`` (so their key's order), into the default
partition in the same transaction that drops the rest. Carried rows that are done later are
deleted row by row, as a purge would: they are few.

Detaching or dropping a partition takes the table's ACCESS EXCLUSIVE lock for a moment
(DETACH CONCURRENTLY is refused while a default partition exists), so every statement is run
under a short ``lock_timeout`` and retried: writers wait at most that long behind it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy import exc

from outbox.errors import ConfigError, OutboxError
from outbox.partition_layout import (
    DEFAULT_AHEAD,
    INTERVALS,
    Names,
    Partition,
    create_range,
    interval_of,
    is_partitioned,
    list_partitions,
    period_start,
)
from outbox.retention import uuid7_floor
from outbox.schema import OutboxTableSpec

#: A partition with more rows than this that are not done is kept even with ``carry``:
#: moving them would hold the table's lock for long. (Most likely the relay is behind.)
CARRY_LIMIT = 10_000
_LOCK_NOT_AVAILABLE = "55P03"

T = TypeVar("T")

# Done: what a purge may delete (the same conditions as the purge_sent query).
_DONE = (
    "((status = 'sent' AND sent_at < :cutoff) "
    "OR (status IN ('rolled_back', 'cancelled') AND resolved_at < :cutoff))"
)


@dataclass
class MaintenanceReport:
    """What one run did (or, dry, would do)."""

    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    detached: list[str] = field(default_factory=list)
    #: partition -> rows moved to the default partition
    carried: dict[str, int] = field(default_factory=dict)
    #: partition -> why it stays
    kept: dict[str, str] = field(default_factory=dict)
    #: carried rows deleted from the default partition once done
    purged: int = 0


def maintain(
    engine: sa.Engine,
    older_than: timedelta,
    *,
    spec: OutboxTableSpec | None = None,
    ahead: int | None = None,
    carry: bool = False,
    detach: bool = False,
    dry_run: bool = False,
    now: datetime | None = None,
    lock_timeout: timedelta = timedelta(seconds=1),
    attempts: int = 10,
) -> MaintenanceReport:
    """Create the coming ``ahead`` partitions and drop (or ``detach``) the ones that ended
    more than ``older_than`` ago and hold only done rows; with ``carry``, move the rows that
    are not done out of such a partition first. See the module's docstring."""
    if older_than < timedelta(0):
        raise ConfigError("older_than must not be negative")
    spec = spec or OutboxTableSpec()
    now = now or datetime.now(UTC)
    cutoff = now - older_than
    with engine.connect() as conn:
        if not is_partitioned(conn, spec):
            raise ConfigError(
                f"{spec.qualified_name} is not partitioned: use `outbox purge` "
                "(or create it with `outbox db upgrade --partitioned daily`)"
            )
        partitions = list_partitions(conn, spec)
    interval = interval_of(partitions)
    report = MaintenanceReport()
    run = _Runner(engine, lock_timeout, attempts)
    starts = {p.start for p in partitions}
    first = period_start(now, interval)
    count = DEFAULT_AHEAD[interval] if ahead is None else ahead
    for step in range(count + 1):
        start = first + INTERVALS[interval] * step
        if start in starts:
            continue
        name = Names(spec).partition(start, interval)
        if not dry_run:
            run(_creator(spec, start, interval))
        report.created.append(name)
    for partition in partitions:
        if partition.end is None or partition.end > cutoff:
            continue
        _retire(run, engine, spec, partition, cutoff, report, carry, detach, dry_run)
    if not dry_run and _default_holds_rows(engine, spec):
        report.purged = _purge_default(engine, spec, cutoff)
    return report


def _creator(
    spec: OutboxTableSpec, start: datetime, interval: str
) -> Callable[[sa.Connection], str]:
    return lambda conn: create_range(conn, spec, start, interval)


def _retire(
    run: _Runner,
    engine: sa.Engine,
    spec: OutboxTableSpec,
    partition: Partition,
    cutoff: datetime,
    report: MaintenanceReport,
    carry: bool,
    detach: bool,
    dry_run: bool,
) -> None:
    names = Names(spec)
    table = names.qualified(partition.name)
    # Read outside any lock: writers and the relay go on meanwhile.
    with engine.connect() as conn:
        live = list(
            conn.execute(
                sa.text(f"SELECT id FROM {table} WHERE NOT {_DONE} LIMIT :limit"),
                {"cutoff": cutoff, "limit": CARRY_LIMIT + 1},
            ).scalars()
        )
    if live and not carry:
        report.kept[partition.name] = f"holds rows not done yet (at least {len(live)})"
        return
    if len(live) > CARRY_LIMIT:
        report.kept[partition.name] = f"holds more than {CARRY_LIMIT} rows not done"
        return
    if dry_run:
        if live:
            report.carried[partition.name] = len(live)
        (report.detached if detach else report.dropped).append(partition.name)
        return
    assert partition.start is not None and partition.end is not None
    bounds = {"low": uuid7_floor(partition.start), "high": uuid7_floor(partition.end)}

    def retire(conn: sa.Connection) -> int | None:
        conn.execute(sa.text(f"ALTER TABLE {names.table} DETACH PARTITION {table}"))
        # Rows that became pending since the read above (a repair's requeue, an operator's
        # commit, which makes a message not yet due scheduled) are found through the partial
        # indexes, which cost nothing to probe here.
        moving = "id = ANY(CAST(:ids AS uuid[])) OR status IN ('pending', 'prepared', 'scheduled')"
        ids = {"ids": live}
        if (
            not carry
            and conn.execute(
                sa.text(f"SELECT EXISTS (SELECT 1 FROM {table} WHERE {moving})"), ids
            ).scalar()
        ):
            return None  # rolled back: the partition is attached again
        columns = ", ".join(f'"{c}"' for c in _columns(conn, table))
        moved = conn.execute(
            sa.text(
                f"INSERT INTO {names.table} ({columns}) OVERRIDING SYSTEM VALUE "
                f"SELECT {columns} FROM {table} WHERE {moving}"
            ),
            ids,
        ).rowcount
        # The keys of the rows that go are given up, as a purge would.
        conn.execute(
            sa.text(
                f"DELETE FROM {names.keys} AS k WHERE k.id >= :low AND k.id < :high "
                f"AND NOT EXISTS (SELECT 1 FROM {names.table} AS o WHERE o.id = k.id)"
            ),
            bounds,
        )
        if detach:
            conn.execute(sa.text(f"DELETE FROM {table} WHERE {moving}"), ids)
        else:
            conn.execute(sa.text(f"DROP TABLE {table}"))
        return int(moved)

    moved = run(retire, rollback_on_none=True)
    if moved is None:
        report.kept[partition.name] = "a row became pending again"
        return
    if moved:
        report.carried[partition.name] = moved
    (report.detached if detach else report.dropped).append(partition.name)


def _columns(conn: sa.Connection, table: str) -> list[str]:
    return list(
        conn.execute(
            sa.text(
                "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:name) "
                "AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
            ),
            {"name": table},
        ).scalars()
    )


def _default_holds_rows(engine: sa.Engine, spec: OutboxTableSpec) -> bool:
    names = Names(spec)
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text(f"SELECT EXISTS (SELECT 1 FROM {names.qualified(names.default)})")
            ).scalar()
        )


def _purge_default(engine: sa.Engine, spec: OutboxTableSpec, cutoff: datetime) -> int:
    """Delete the default partition's done rows (carried ones), in short batches."""
    names = Names(spec)
    default = names.qualified(names.default)
    statement = sa.text(
        f"DELETE FROM {default} WHERE id IN (SELECT id FROM {default} "
        f"WHERE id < :cutoff_id AND {_DONE} LIMIT 1000 FOR UPDATE SKIP LOCKED)"
    )
    total = 0
    while True:
        with engine.begin() as conn:
            deleted = conn.execute(
                statement, {"cutoff": cutoff, "cutoff_id": uuid7_floor(cutoff)}
            ).rowcount
        total += deleted
        if deleted < 1000:
            return total


class _Runner:
    """Runs a step in its own transaction under a short lock_timeout, retrying when the lock
    is not had in time: writers queue behind a waiting DDL statement for at most that long."""

    def __init__(self, engine: sa.Engine, lock_timeout: timedelta, attempts: int) -> None:
        self.engine = engine
        self.milliseconds = max(1, int(lock_timeout.total_seconds() * 1000))
        self.attempts = attempts

    def __call__(self, step: Callable[[sa.Connection], T], *, rollback_on_none: bool = False) -> T:
        for attempt in range(self.attempts):
            try:
                with self.engine.connect() as conn:
                    with conn.begin() as transaction:
                        conn.execute(sa.text(f"SET LOCAL lock_timeout = {self.milliseconds}"))
                        result = step(conn)
                        if result is None and rollback_on_none:
                            transaction.rollback()
                    return result
            except exc.OperationalError as error:
                if getattr(error.orig, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                    raise
                time.sleep(min(5.0, 0.1 * 2**attempt))
        raise OutboxError(
            f"the outbox table stayed locked by other transactions through {self.attempts} "
            "attempts; try again later"
        )
