"""The partitioned layout of the outbox table: one partition per day or hour of message ids.

The table is partitioned by RANGE on ``id``. Ids are UUIDv7, whose first 48 bits are the
millisecond the publisher made them, so a range of ids is a range of publish times and the
primary key stays ``(id)``: PostgreSQL requires the partition key in every unique
constraint, and here it is the whole key, so a message id stays unique across partitions.
A row never moves between partitions on update (no statement changes an id).

The idempotency key cannot have a unique index of its own on a partitioned table. It gets a
side table instead, ``<table>_idempotency_keys``, whose primary key carries the name the plain
layout gives its unique index (``<table>_idempotency_key_idx``), kept by row triggers in the
writer's own transaction: the same guarantee, the same error for a duplicate.

A default partition takes any id no range covers (a client clock far ahead, a maintenance
run missed), so a writer never fails for want of a partition. ``outbox partitions maintain``
creates the ranges ahead of time and drops old ones (:mod:`outbox.partition_retention`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from outbox.errors import ConfigError
from outbox.retention import uuid7_floor
from outbox.schema import OutboxTableSpec

#: Partition sizes, by name (``outbox db upgrade --layout partitioned --interval ...``).
INTERVALS = {
    "daily": timedelta(days=1),
    "hourly": timedelta(hours=1),
    "minutely": timedelta(minutes=1),
}
#: The suffix of a range partition's name, by interval: ``<table>_p20261127`` (daily) or
#: ``<table>_p2026112722`` (hourly). Maintenance reads the interval back from it.
_NAME_FORMATS = {"daily": "%Y%m%d", "hourly": "%Y%m%d%H", "minutely": "%Y%m%d%H%M"}
#: Range partitions made ahead of the current one when the layout is created.
DEFAULT_AHEAD = {"daily": 7, "hourly": 48, "minutely": 10}

#: The scheduled messages' index (revision 0010), after ``ON <table>``.
SCHEDULED_INDEX_DEFINITION = "(shard, deliver_at, seq) WHERE status = 'scheduled'"

_BOUNDS = re.compile(r"FROM \('([0-9a-f-]{36})'\) TO \('([0-9a-f-]{36})'\)")


def period_start(moment: datetime, interval: str) -> datetime:
    """The start (UTC) of the day or hour holding ``moment``."""
    moment = moment.astimezone(UTC)
    if interval == "daily":
        return moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if interval == "hourly":
        return moment.replace(minute=0, second=0, microsecond=0)
    return moment.replace(second=0, microsecond=0)


def check_interval(interval: str) -> str:
    if interval not in INTERVALS:
        raise ConfigError(f"partition interval must be one of {', '.join(INTERVALS)}")
    return interval


@dataclass(frozen=True)
class Partition:
    """One partition of the table: a range of publish times, or the default (no range)."""

    name: str
    start: datetime | None
    end: datetime | None

    @property
    def is_default(self) -> bool:
        return self.start is None


class Names:
    """The quoted names of one table's partitioned layout."""

    def __init__(self, spec: OutboxTableSpec) -> None:
        self.spec = spec
        self.schema = f'"{spec.schema}"'
        self.table = f'{self.schema}."{spec.table}"'
        self.keys = f'{self.schema}."{spec.table}_idempotency_keys"'
        self.keys_constraint = spec.idempotency_index  # the name the publisher looks for
        self.lookup_index = f"{spec.table}_idempotency_lookup_idx"
        self.default = f"{spec.table}_default"

    def partition(self, start: datetime, interval: str) -> str:
        return f"{self.spec.table}_p{start.strftime(_NAME_FORMATS[interval])}"

    def qualified(self, name: str) -> str:
        return f'{self.schema}."{name}"'

    def function(self, purpose: str) -> str:
        return f'{self.schema}."{self.spec.table}_keys_{purpose}"'


def is_partitioned(conn: sa.Connection, spec: OutboxTableSpec) -> bool:
    """Whether the outbox table has the partitioned layout."""
    kind = conn.execute(
        sa.text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:name)"),
        {"name": Names(spec).table},
    ).scalar()
    return kind == "p"


def list_partitions(conn: sa.Connection, spec: OutboxTableSpec) -> list[Partition]:
    """The table's partitions, oldest range first, the default partition last."""
    rows = conn.execute(
        sa.text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits AS i "
            "JOIN pg_class AS c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:name)"
        ),
        {"name": Names(spec).table},
    ).all()
    found = []
    for name, bound in rows:
        match = _BOUNDS.search(bound)
        if match is None:
            found.append(Partition(name, None, None))
            continue
        low, high = (_uuid_time(uuid.UUID(text)) for text in match.groups())
        found.append(Partition(name, low, high))
    far = datetime.max.replace(tzinfo=UTC)
    return sorted(found, key=lambda p: p.start or far)


def interval_of(partitions: list[Partition]) -> str:
    """The layout's interval, read back from its range partitions' width."""
    for partition in partitions:
        if partition.start is not None and partition.end is not None:
            width = partition.end - partition.start
            return next(name for name, size in INTERVALS.items() if width >= size)
    return "daily"


def _uuid_time(value: uuid.UUID) -> datetime:
    return datetime.fromtimestamp((value.int >> 80) / 1000, UTC)


def create_range(conn: sa.Connection, spec: OutboxTableSpec, start: datetime, interval: str) -> str:
    """Create the range partition starting at ``start``. Rows of its range that the default
    partition holds (a client clock ahead) move into it in the same transaction, triggers
    off for them: the idempotency side table already holds their keys."""
    names = Names(spec)
    name = names.partition(start, interval)
    end = start + INTERVALS[interval]
    low, high = uuid7_floor(start), uuid7_floor(end)
    default = names.qualified(names.default)
    columns = _columns(conn, spec)
    conn.execute(
        sa.text(
            f"CREATE TABLE {names.qualified(name)} "
            f"(LIKE {names.table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE)"
        )
    )
    conn.execute(
        sa.text(
            f"WITH moved AS (DELETE FROM {default} WHERE id >= :low AND id < :high "
            f"RETURNING {columns}) INSERT INTO {names.qualified(name)} ({columns}) "
            f"SELECT {columns} FROM moved"
        ),
        {"low": low, "high": high},
    )
    # The default partition's delete trigger gave the moved rows' keys up: take them back.
    conn.execute(
        sa.text(
            f"INSERT INTO {names.keys} (idempotency_key, id) SELECT idempotency_key, id "
            f"FROM {names.qualified(name)} WHERE idempotency_key IS NOT NULL "
            "ON CONFLICT DO NOTHING"
        )
    )
    conn.execute(
        sa.text(
            f"ALTER TABLE {names.table} ATTACH PARTITION {names.qualified(name)} "
            f"FOR VALUES FROM ('{low}') TO ('{high}')"
        )
    )
    return name


def _columns(conn: sa.Connection, spec: OutboxTableSpec) -> str:
    names = conn.execute(
        sa.text(
            "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:name) "
            "AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
        ),
        {"name": Names(spec).table},
    ).scalars()
    return ", ".join(f'"{name}"' for name in names)


def convert(
    conn: sa.Connection,
    spec: OutboxTableSpec,
    *,
    partitioned: bool,
    interval: str = "daily",
    ahead: int | None = None,
    now: datetime | None = None,
) -> None:
    """Rebuild the outbox table (at the head revision) in the other layout, rows and grants
    included, in the caller's transaction: with ``partitioned``, as a table partitioned by
    ``interval`` with ``ahead`` ranges made after the current one; without, as a plain table.

    The rows are copied under the table's exclusive lock: meant for a new or small table.
    """
    check_interval(interval)
    names = Names(spec)
    if is_partitioned(conn, spec) == partitioned:
        return
    now = now or datetime.now(UTC)
    conn.execute(sa.text(f"LOCK TABLE {names.table} IN ACCESS EXCLUSIVE MODE"))
    grants = _grants(conn, names.table)
    oldest = conn.execute(sa.text(f"SELECT id FROM {names.table} ORDER BY id LIMIT 1")).scalar()
    # The wake trigger as the revisions left it, to be made again on the rebuilt table.
    wake = conn.execute(
        sa.text(
            "SELECT pg_get_triggerdef(oid) FROM pg_trigger "
            "WHERE tgrelid = to_regclass(:table) AND tgname = :name"
        ),
        {"table": names.table, "name": spec.wake_function},
    ).scalar()
    before = f"{spec.table}_before"
    old = names.qualified(before)
    # The old table's indexes, triggers and side table hold the names the new ones take.
    conn.execute(sa.text(f'DROP TRIGGER IF EXISTS "{spec.wake_function}" ON {names.table}'))
    conn.execute(sa.text(f"DROP TABLE IF EXISTS {names.keys}"))
    conn.execute(sa.text(f"DROP INDEX IF EXISTS {names.qualified(spec.idempotency_index)}"))
    conn.execute(sa.text(f"DROP INDEX IF EXISTS {names.qualified(names.lookup_index)}"))
    for purpose in ("insert", "release"):
        conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {names.function(purpose)}() CASCADE"))
    conn.execute(sa.text(f'ALTER TABLE {names.table} RENAME TO "{before}"'))
    conn.execute(
        sa.text(f'ALTER TABLE {old} RENAME CONSTRAINT "{spec.table}_pkey" TO "{before}_pkey"')
    )
    for index in ("pending_idx", "retry_idx", "lease_idx", "prepared_idx", "scheduled_idx"):
        conn.execute(
            sa.text(
                f"ALTER INDEX IF EXISTS {names.qualified(f'{spec.table}_{index}')} "
                f'RENAME TO "{before}_{index}"'
            )
        )
    by = " PARTITION BY RANGE (id)" if partitioned else ""
    conn.execute(
        sa.text(
            f"CREATE TABLE {names.table} (LIKE {old} INCLUDING DEFAULTS INCLUDING IDENTITY "
            f"INCLUDING CONSTRAINTS INCLUDING STORAGE){by}"
        )
    )
    columns = _columns(conn, spec)
    if partitioned:
        first = period_start(_uuid_time(oldest) if oldest else now, interval)
        _partitions(conn, spec, interval, first, ahead, now)
        _keys_table(conn, names)
    conn.execute(sa.text(f"ALTER TABLE {names.table} ADD PRIMARY KEY (id)"))
    _indexes(conn, spec, names, partitioned)
    conn.execute(
        sa.text(
            f"INSERT INTO {names.table} ({columns}) OVERRIDING SYSTEM VALUE "
            f"SELECT {columns} FROM {old}"
        )
    )
    conn.execute(
        sa.text(
            f"SELECT setval(pg_get_serial_sequence('{names.table}', 'seq'), "
            f"coalesce((SELECT max(seq) FROM {old}), 0) + 1, false)"
        )
    )
    conn.execute(sa.text(f"DROP TABLE {old} CASCADE"))
    for privilege, grantee in grants:
        conn.execute(sa.text(f"GRANT {privilege} ON {names.table} TO {grantee}"))
    if wake is not None:
        conn.execute(sa.text(wake))


def _partitions(
    conn: sa.Connection,
    spec: OutboxTableSpec,
    interval: str,
    first: datetime,
    ahead: int | None,
    now: datetime,
) -> None:
    names = Names(spec)
    conn.execute(
        sa.text(f"CREATE TABLE {names.qualified(names.default)} PARTITION OF {names.table} DEFAULT")
    )
    last = period_start(now, interval) + INTERVALS[interval] * (
        DEFAULT_AHEAD[interval] if ahead is None else ahead
    )
    start = first
    while start <= last:
        end = start + INTERVALS[interval]
        conn.execute(
            sa.text(
                f"CREATE TABLE {names.qualified(names.partition(start, interval))} "
                f"PARTITION OF {names.table} FOR VALUES FROM ('{uuid7_floor(start)}') "
                f"TO ('{uuid7_floor(end)}')"
            )
        )
        start = end


def _indexes(conn: sa.Connection, spec: OutboxTableSpec, names: Names, partitioned: bool) -> None:
    table, name = names.table, spec.table
    statements = [
        f"CREATE INDEX \"{name}_pending_idx\" ON {table} (shard, seq) WHERE status = 'pending'",
        f'CREATE INDEX "{name}_retry_idx" ON {table} (shard, topic, key, seq) '
        "WHERE status = 'pending' AND next_attempt_at IS NOT NULL",
        f'CREATE INDEX "{name}_lease_idx" ON {table} (shard, topic, key, seq) '
        "WHERE status = 'pending' AND lease_until IS NOT NULL",
        f'CREATE INDEX "{name}_prepared_idx" ON {table} (check_group, next_check_at) '
        "WHERE status = 'prepared'",
    ]
    if _has_column(conn, spec, "deliver_at"):  # scheduled messages (revision 0010)
        statements.append(
            f'CREATE INDEX "{name}_scheduled_idx" ON {table} {SCHEDULED_INDEX_DEFINITION}'
        )
    if partitioned:
        # Not unique (the side table is): finds a key's message, a probe per partition.
        statements.append(
            f'CREATE INDEX "{names.lookup_index}" ON {table} (idempotency_key) '
            "WHERE idempotency_key IS NOT NULL"
        )
    else:
        statements.append(
            f'CREATE UNIQUE INDEX "{spec.idempotency_index}" ON {table} (idempotency_key) '
            "WHERE idempotency_key IS NOT NULL"
        )
    for statement in statements:
        conn.execute(sa.text(statement))


def _has_column(conn: sa.Connection, spec: OutboxTableSpec, column: str) -> bool:
    """Whether the table has ``column``: the layout is rebuilt at whichever revision the
    table is (0009 converts it before 0010 adds scheduled messages; its downgrade after)."""
    return bool(
        conn.execute(
            sa.text(
                "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(:name) "
                "AND attname = :column AND NOT attisdropped)"
            ),
            {"name": Names(spec).table, "column": column},
        ).scalar()
    )


def build_index_concurrently(
    conn: sa.Connection, spec: OutboxTableSpec, suffix: str, definition: str
) -> None:
    """Give the partitioned table the index ``<table>_<suffix>`` (``definition``: what follows
    ``ON <table>``) without holding up writers, on ``conn`` in autocommit.

    PostgreSQL builds no index concurrently on a partitioned table, so the parent's is made
    alone (``ON ONLY``: invalid, nothing read), each partition's is built concurrently and
    attached; the parent's becomes valid with the last one. A run interrupted anywhere can be
    run again: an attached partition is passed over, a half-built index made again. A
    partition attached meanwhile gets its index from the attach itself.
    """
    names = Names(spec)
    parent = names.qualified(f"{spec.table}_{suffix}")
    conn.execute(
        sa.text(
            f'CREATE INDEX IF NOT EXISTS "{spec.table}_{suffix}" ON ONLY {names.table} {definition}'
        )
    )
    for partition in list_partitions(conn, spec):
        attached = conn.execute(
            sa.text(
                "SELECT EXISTS (SELECT 1 FROM pg_inherits AS i "
                "JOIN pg_index AS x ON x.indexrelid = i.inhrelid "
                "WHERE i.inhparent = to_regclass(:parent) "
                "AND x.indrelid = to_regclass(:partition))"
            ),
            {"parent": parent, "partition": names.qualified(partition.name)},
        ).scalar()
        if attached:
            continue
        child = names.qualified(f"{partition.name}_{suffix}")
        conn.execute(sa.text(f"DROP INDEX CONCURRENTLY IF EXISTS {child}"))
        conn.execute(
            sa.text(
                f'CREATE INDEX CONCURRENTLY "{partition.name}_{suffix}" '
                f"ON {names.qualified(partition.name)} {definition}"
            )
        )
        conn.execute(sa.text(f"ALTER INDEX {parent} ATTACH PARTITION {child}"))


def _keys_table(conn: sa.Connection, names: Names) -> None:
    """The idempotency keys' side table and the row triggers that keep it, in the writer's
    transaction. The functions run as their owner: writers need no grant on the side table."""
    table = names.table
    conn.execute(
        sa.text(
            f"CREATE TABLE {names.keys} (idempotency_key text NOT NULL, id uuid NOT NULL, "
            f'CONSTRAINT "{names.keys_constraint}" PRIMARY KEY (idempotency_key))'
        )
    )
    conn.execute(
        sa.text(f'CREATE INDEX "{names.spec.table}_idempotency_keys_id_idx" ON {names.keys} (id)')
    )
    # A key held by another message: a plain insert fails as the plain layout's unique index
    # would (same constraint name); a prepared insert (ON CONFLICT DO NOTHING in the plain
    # layout) is skipped, as that clause would. The same id again (rows moved between
    # partitions by maintenance) is no conflict.
    conn.execute(
        sa.text(
            f"CREATE FUNCTION {names.function('insert')}() RETURNS trigger LANGUAGE plpgsql "
            "SECURITY DEFINER SET search_path = pg_catalog AS $keys$\n"
            "BEGIN\n"
            f"  INSERT INTO {names.keys} (idempotency_key, id) "
            "VALUES (NEW.idempotency_key, NEW.id) ON CONFLICT DO NOTHING;\n"
            f"  IF FOUND OR EXISTS (SELECT 1 FROM {names.keys} "
            "WHERE idempotency_key = NEW.idempotency_key AND id = NEW.id) THEN\n"
            "    RETURN NEW;\n"
            "  END IF;\n"
            "  IF NEW.status = 'prepared' THEN\n"
            "    RETURN NULL;\n"
            "  END IF;\n"
            "  RAISE unique_violation USING\n"
            f"    MESSAGE = 'duplicate key value violates unique constraint "
            f'"{names.keys_constraint}"\',\n'
            "    DETAIL = format('Key (idempotency_key)=(%s) already exists.', "
            "NEW.idempotency_key),\n"
            f"    CONSTRAINT = '{names.keys_constraint}', TABLE = '{names.spec.table}';\n"
            "END\n$keys$"
        )
    )
    conn.execute(
        sa.text(
            f"CREATE FUNCTION {names.function('release')}() RETURNS trigger LANGUAGE plpgsql "
            "SECURITY DEFINER SET search_path = pg_catalog AS $keys$\n"
            "BEGIN\n"
            f"  DELETE FROM {names.keys} "
            "WHERE idempotency_key = OLD.idempotency_key AND id = OLD.id;\n"
            "  IF TG_OP = 'UPDATE' AND NEW.idempotency_key IS NOT NULL THEN\n"
            f"    INSERT INTO {names.keys} (idempotency_key, id) "
            "VALUES (NEW.idempotency_key, NEW.id);\n"
            "  END IF;\n"
            "  RETURN NULL;\n"
            "END\n$keys$"
        )
    )
    conn.execute(
        sa.text(
            f'CREATE TRIGGER "{names.spec.table}_keys_insert" BEFORE INSERT ON {table} '
            "FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL) "
            f"EXECUTE FUNCTION {names.function('insert')}()"
        )
    )
    conn.execute(
        sa.text(
            f'CREATE TRIGGER "{names.spec.table}_keys_update" AFTER UPDATE OF idempotency_key '
            f"ON {table} FOR EACH ROW "
            "WHEN (OLD.idempotency_key IS DISTINCT FROM NEW.idempotency_key) "
            f"EXECUTE FUNCTION {names.function('release')}()"
        )
    )
    conn.execute(
        sa.text(
            f'CREATE TRIGGER "{names.spec.table}_keys_delete" AFTER DELETE ON {table} '
            "FOR EACH ROW WHEN (OLD.idempotency_key IS NOT NULL) "
            f"EXECUTE FUNCTION {names.function('release')}()"
        )
    )


def _grants(conn: sa.Connection, table: str) -> list[tuple[str, str]]:
    rows = conn.execute(
        sa.text(
            "SELECT a.privilege_type, CASE WHEN a.grantee = 0 THEN 'PUBLIC' "
            "ELSE quote_ident(pg_get_userbyid(a.grantee)) END "
            "FROM pg_class AS c, aclexplode(c.relacl) AS a "
            "WHERE c.oid = to_regclass(:name) AND a.grantee <> c.relowner"
        ),
        {"name": table},
    ).all()
    return [(str(privilege), str(grantee)) for privilege, grantee in rows]
