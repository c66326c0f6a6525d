"""Where every message stands, read in one short transaction (``outbox status``).

Cheap on a large table: pending and prepared rows are counted through their partial indexes
(a table of millions of sent rows costs what its backlog costs), the other statuses come from
the planner's statistics unless ``exact`` asks for one scan of the table. Relays are found by
the advisory locks they hold (see :mod:`outbox.relay.leases`), not by anything they write:
a relay that died holds nothing, at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import sqlalchemy as sa

from outbox.queries import Queries
from outbox.schema import (
    CANCELLED,
    DEAD,
    PENDING,
    PREPARED,
    ROLLED_BACK,
    SCHEDULED,
    SENT,
    SHARD_COUNT,
    STATUSES,
)
from outbox.wal.slots import SlotState, slot_name, slot_state

if TYPE_CHECKING:
    from outbox.inbox.lag import GroupLag

#: Statuses counted through a partial index, always exactly.
INDEXED = (PENDING, PREPARED, SCHEDULED)
#: The others: estimated, or counted by one scan of the table (``exact``).
UNINDEXED = (SENT, DEAD, ROLLED_BACK, CANCELLED)


@dataclass
class TopicStatus:
    """One topic's rows. ``sent``, ``dead``, ``rolled_back`` and ``cancelled`` are None unless
    counted exactly (``exact``). ``overdue``: scheduled messages due more than a second ago
    that no relay made pending yet; ``next_due_seconds``: until the next is due."""

    topic: str
    pending: int = 0
    backing_off: int = 0
    oldest_pending_seconds: float | None = None
    prepared: int = 0
    oldest_prepared_seconds: float | None = None
    scheduled: int = 0
    overdue: int = 0
    next_due_seconds: float | None = None
    sent: int | None = None
    dead: int | None = None
    rolled_back: int | None = None
    cancelled: int | None = None


@dataclass
class StatusCount:
    """Rows of one status in the whole table; ``count`` None when not even an estimate is
    known (a table never analyzed)."""

    count: int | None
    estimate: bool


@dataclass
class RelayStatus:
    """A relay connected to the table (its owner session)."""

    name: str
    pid: int
    client_addr: str | None
    connected_since: datetime | None
    #: Takes part in sharing the shards (a relay that cannot reach Kafka, or stepped aside
    #: after failing take-overs, is connected but no member).
    member: bool = False
    #: Its last take-over or batch worked and nothing failed since.
    serving: bool = False
    shards: list[int] = field(default_factory=list)


@dataclass
class PreparedGroup:
    check_group: str
    count: int
    oldest_seconds: float


@dataclass
class ParkedCount:
    consumer_group: str
    topic: str
    status: str
    count: int
    oldest_seconds: float


@dataclass
class OutboxStatus:
    table: str
    taken_at: datetime
    exact: bool
    statuses: dict[str, StatusCount]
    topics: list[TopicStatus]
    relays: list[RelayStatus]
    unowned_shards: list[int]
    prepared_groups: list[PreparedGroup]
    shard_count: int = SHARD_COUNT
    #: The inbox's parked table, when it exists in this database; None otherwise.
    inbox_table: str | None = None
    parked: list[ParkedCount] = field(default_factory=list)
    #: The WAL source's replication slot, when there is one: who reads it and the WAL it
    #: holds back (see :mod:`outbox.wal`); None for a table read only by the table relay.
    wal_slot: SlotState | None = None
    #: The inbox's consumer groups, when the inbox tables are in this database.
    inbox_groups: list[str] = field(default_factory=list)
    #: Their lag, read from Kafka when asked for (None: not asked).
    lag: list[GroupLag] | None = None

    @property
    def overdue(self) -> int:
        """Scheduled messages due more than a second ago and still scheduled."""
        return sum(t.overdue for t in self.topics)

    @property
    def oldest_pending_seconds(self) -> float | None:
        ages = [t.oldest_pending_seconds for t in self.topics if t.oldest_pending_seconds]
        return max(ages) if ages else None


@dataclass
class InboxStatus:
    """A consumer's own database: the inbox tables, and no outbox table (so no dead letters,
    which go through an outbox table beside the inbox's)."""

    table: str
    taken_at: datetime
    #: The outbox table looked for, and not found.
    outbox_table: str
    #: The consumer groups that applied or parked a message here.
    groups: list[str]
    parked_table: str
    parked: list[ParkedCount]
    #: Their lag, read from Kafka when asked for (None: not asked).
    lag: list[GroupLag] | None = None


def read_any_status(
    engine: sa.Engine,
    queries: Queries,
    *,
    exact: bool = False,
    inbox: tuple[str, str] = ("public", "inbox"),
) -> OutboxStatus | InboxStatus:
    """:func:`read_status`, or, in a database with the inbox tables and no outbox table (a
    consumer's own), :func:`read_inbox_status`."""
    with engine.connect() as conn:
        outbox_found = _exists(conn, queries.spec.qualified_name)
    if not outbox_found and (inbox_status := read_inbox_status(engine, queries, inbox)):
        return inbox_status
    return read_status(engine, queries, exact=exact, inbox=inbox)


def read_inbox_status(
    engine: sa.Engine, queries: Queries, inbox: tuple[str, str]
) -> InboxStatus | None:
    """The inbox's state in a database without the outbox table: its groups and parked
    messages; None when the inbox tables are not there either."""
    from outbox.inbox.schema import InboxTableSpec
    from outbox.inbox.store import InboxStore

    store = InboxStore(InboxTableSpec(schema=inbox[0], table=inbox[1]))
    with engine.begin() as conn:
        conn.execute(sa.text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
        if store.check(conn) is not None:
            return None
        taken_at = conn.execute(sa.text("SELECT now()")).scalar_one()
        parked_table, parked = read_parked(conn, inbox)
        groups = store.groups(conn)
    assert parked_table is not None
    return InboxStatus(
        table=store.spec.qualified_name,
        taken_at=taken_at,
        outbox_table=queries.spec.qualified_name,
        groups=groups,
        parked_table=parked_table,
        parked=parked,
    )


def inbox_groups(engine: sa.Engine, inbox: tuple[str, str]) -> list[str]:
    """The consumer groups of the inbox tables ``inbox`` names, if they are in this
    database."""
    from outbox.inbox.schema import InboxTableSpec
    from outbox.inbox.store import InboxStore

    store = InboxStore(InboxTableSpec(schema=inbox[0], table=inbox[1]))
    with engine.connect() as conn:
        return [] if store.check(conn) is not None else store.groups(conn)


def _exists(conn: sa.Connection, name: str) -> bool:
    found = conn.execute(sa.text("SELECT to_regclass(:name) IS NOT NULL"), {"name": name})
    return bool(found.scalar_one())


def read_status(
    engine: sa.Engine,
    queries: Queries,
    *,
    exact: bool = False,
    inbox: tuple[str, str] | None = ("public", "inbox"),
) -> OutboxStatus:
    """Read the table's status. ``inbox`` is the (schema, table) of the inbox tables whose
    parked rows to count, if they exist in the same database."""
    spec = queries.spec
    with engine.begin() as conn:
        # One snapshot for every count. The partial indexes are the way to pending and
        # prepared rows whatever the statistics say: they go stale on the outbox (statistics
        # taken during a backlog make a scan of every sent row look cheap).
        conn.execute(sa.text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
        taken_at = conn.execute(sa.text("SELECT now()")).scalar_one()
        topics: dict[str, TopicStatus] = {}
        for row in conn.execute(queries["status_pending"]):
            t = topics.setdefault(row.topic, TopicStatus(row.topic))
            t.pending, t.backing_off = row.pending, row.backing_off
            t.oldest_pending_seconds = float(row.oldest)
        groups: dict[str, PreparedGroup] = {}
        for row in conn.execute(queries["status_prepared"]):
            t = topics.setdefault(row.topic, TopicStatus(row.topic))
            t.prepared += row.prepared
            t.oldest_prepared_seconds = max(t.oldest_prepared_seconds or 0.0, float(row.oldest))
            name = row.check_group or "-"
            group = groups.setdefault(name, PreparedGroup(name, 0, 0.0))
            group.count += row.prepared
            group.oldest_seconds = max(group.oldest_seconds, float(row.oldest))
        for row in conn.execute(queries["status_scheduled"]):
            t = topics.setdefault(row.topic, TopicStatus(row.topic))
            t.scheduled, t.overdue = row.scheduled, row.overdue
            t.next_due_seconds = float(row.next_due)
        statuses = {
            status: StatusCount(sum(getattr(t, status) for t in topics.values()), False)
            for status in INDEXED
        }
        if exact:
            conn.execute(sa.text("SET LOCAL enable_seqscan = on"))
            counted = {status: 0 for status in UNINDEXED}
            for row in conn.execute(queries["status_by_topic"]):
                if row.status in counted:
                    t = topics.setdefault(row.topic, TopicStatus(row.topic))
                    setattr(t, row.status, row.n)
                    counted[row.status] += row.n
            for t in topics.values():
                for status in counted:
                    if getattr(t, status) is None:
                        setattr(t, status, 0)
            statuses.update({s: StatusCount(n, False) for s, n in counted.items()})
        else:
            estimates = _estimates(conn, queries)
            for status in UNINDEXED:
                statuses[status] = StatusCount(
                    estimates.get(status, 0 if estimates else None), True
                )
        relays = _relays(conn, queries)
        inbox_table, parked = read_parked(conn, inbox) if inbox else (None, [])
        driver = conn.connection.driver_connection  # psycopg's, in the same transaction
        assert driver is not None
        wal_slot = slot_state(driver, slot_name(spec))
    owned = {shard for relay in relays for shard in relay.shards}
    return OutboxStatus(
        table=spec.qualified_name,
        taken_at=taken_at,
        exact=exact,
        statuses={status: statuses[status] for status in STATUSES},
        topics=sorted(topics.values(), key=lambda t: t.topic),
        relays=relays,
        unowned_shards=[shard for shard in range(SHARD_COUNT) if shard not in owned],
        prepared_groups=sorted(groups.values(), key=lambda g: g.check_group),
        inbox_table=inbox_table,
        parked=parked,
        wal_slot=wal_slot,
    )


def _estimates(conn: sa.Connection, queries: Queries) -> dict[str, int]:
    spec = queries.spec
    params = {
        "schema": spec.schema,
        "table_name": spec.table,
        "qualified_name": f'"{spec.schema}"."{spec.table}"',
    }
    return {
        row.status: int(row.estimate) for row in conn.execute(queries["status_estimates"], params)
    }


def _relays(conn: sa.Connection, queries: Queries) -> list[RelayStatus]:
    spec = queries.spec
    spaces = {
        "session_space": spec.lock_space("session"),
        "member_space": spec.lock_space("member"),
        "serving_space": spec.lock_space("serving"),
        "shard_space": spec.lock_space("shard"),
    }
    rows = conn.execute(queries["status_relays"], spaces).all()
    # The owner session holds every lock of its relay: one relay per session holding a
    # session lock (a shard lock without one would be a relay that is just connecting).
    relays: dict[int, RelayStatus] = {}
    for row in rows:
        if row.space == spaces["session_space"]:
            relays.setdefault(
                row.pid,
                RelayStatus(
                    row.application_name or "?", row.pid, row.client_addr, row.backend_start
                ),
            )
    for row in rows:
        relay = relays.get(row.pid)
        if relay is None:
            continue
        if row.space == spaces["member_space"]:
            relay.member = True
        elif row.space == spaces["serving_space"]:
            relay.serving = True
        elif row.space == spaces["shard_space"]:
            relay.shards.append(int(row.number))
    for relay in relays.values():
        relay.shards.sort()
    return list(relays.values())


def read_parked(
    conn: sa.Connection, inbox: tuple[str, str]
) -> tuple[str | None, list[ParkedCount]]:
    """Parked inbox rows per group, topic and status, if the inbox tables (``inbox``: their
    schema and table) exist in ``conn``'s database: the parked table's name and the counts,
    else None and none."""
    from outbox.inbox.schema import InboxTableSpec

    spec = InboxTableSpec(schema=inbox[0], table=inbox[1])
    name = f"{spec.schema}.{spec.parked_name}"
    if not _exists(conn, name):
        return None, []
    p = spec.parked
    rows = conn.execute(
        sa.select(
            p.c.consumer_group,
            p.c.topic,
            p.c.status,
            sa.func.count().label("n"),
            sa.extract("epoch", sa.func.now() - sa.func.min(p.c.parked_at)).label("oldest"),
        )
        .group_by(p.c.consumer_group, p.c.topic, p.c.status)
        .order_by(p.c.consumer_group, p.c.topic, p.c.status)
    )
    return name, [
        ParkedCount(r.consumer_group, r.topic, r.status, r.n, float(r.oldest)) for r in rows
    ]
