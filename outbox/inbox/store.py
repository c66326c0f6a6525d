"""Every statement the inbox runs, behind named functions: the runner never sees SQL.

Functions take a SQLAlchemy ``Session``/``Connection`` (or their async twins through
``run_sync``) already in a transaction; the caller decides what commits together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from outbox.errors import ConfigError, OutboxError
from outbox.inbox.api import RawRecord
from outbox.inbox.schema import PARKED, RETRY, InboxTableSpec

if TYPE_CHECKING:
    from outbox.inbox.dead_letter_retry import DeadLetter


@dataclass(frozen=True)
class Claim:
    """An inbox row to insert: the message identity and where the record was read."""

    message_id: str
    topic: str
    partition: int
    offset: int


class InboxStore:
    """The inbox's statements for one pair of tables."""

    def __init__(self, spec: InboxTableSpec) -> None:
        self.spec = spec
        self.inbox = spec.inbox
        self.parked = spec.parked
        # One statement text whatever the batch size (arrays, not a VALUES list), so that
        # neither SQLAlchemy nor PostgreSQL plans it again for every batch.
        self._claim = sa.text(
            f'INSERT INTO "{spec.schema}"."{spec.table}"'
            " (consumer_group, message_id, topic, kafka_partition, kafka_offset)"
            " SELECT :group, u.message_id, u.topic, u.kafka_partition, u.kafka_offset"
            " FROM unnest(CAST(:ids AS text[]), CAST(:topics AS text[]),"
            " CAST(:partitions AS integer[]), CAST(:offsets AS bigint[]))"
            " AS u(message_id, topic, kafka_partition, kafka_offset)"
            " ORDER BY u.message_id"
            " ON CONFLICT DO NOTHING RETURNING message_id"
        )

    # -- applying -----------------------------------------------------------------------------

    def claim_many(self, conn: Any, group: str, claims: Sequence[Claim]) -> set[str]:
        """Insert inbox rows; return the ids that were new (the others were applied before).

        Rows go in id order, so two consumers claiming overlapping sets (a partition that
        moved mid-batch) wait for each other instead of deadlocking; the second then finds
        the first's rows and skips them.
        """
        if not claims:
            return set()
        unique = sorted({c.message_id: c for c in claims}.items())
        params = {
            "group": group,
            "ids": [message_id for message_id, _ in unique],
            "topics": [c.topic for _, c in unique],
            "partitions": [c.partition for _, c in unique],
            "offsets": [c.offset for _, c in unique],
        }
        return set(conn.execute(self._claim, params).scalars().all())

    def claim_one(self, conn: Any, group: str, claim: Claim) -> bool:
        """Insert one inbox row; False when the message was applied before."""
        return bool(self.claim_many(conn, group, [claim]))

    def park(
        self,
        conn: Any,
        group: str,
        record: RawRecord,
        message_id: str | None,
        reason: str,
        error: str,
        attempts: int,
    ) -> int | None:
        """Record a message the runner gives up on; returns the parked row's id, or None if
        this record was parked already."""
        names = [name for name, _ in record.headers] or None
        values = [value for _, value in record.headers] or None
        statement = (
            insert(self.parked)
            .values(
                consumer_group=group,
                message_id=message_id,
                topic=record.topic,
                kafka_partition=record.partition,
                kafka_offset=record.offset,
                key=record.key,
                value=record.value,
                header_names=names,
                header_values=values,
                reason=reason,
                error=error[:4000],
                attempts=attempts,
            )
            .on_conflict_do_nothing()
            .returning(self.parked.c.id)
        )
        row = conn.execute(statement).first()
        return None if row is None else int(row[0])

    # -- parked messages an operator asked to retry -------------------------------------------

    def take_requeued(self, conn: Any, group: str, limit: int) -> list[Any]:
        """Parked rows marked for retry, locked (others skip them), oldest first."""
        p = self.parked
        statement = (
            sa.select(p)
            .where(p.c.consumer_group == group, p.c.status == RETRY)
            .order_by(p.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        return list(conn.execute(statement).all())

    def unpark(self, conn: Any, parked_id: int) -> None:
        conn.execute(sa.delete(self.parked).where(self.parked.c.id == parked_id))

    def repark(self, conn: Any, parked_id: int, error: str) -> None:
        """A retried message failed again: parked again with its new error, and dated now
        (``parked_at`` is when it was last parked)."""
        p = self.parked
        conn.execute(
            sa.update(p)
            .where(p.c.id == parked_id)
            .values(
                status=PARKED,
                error=error[:4000],
                attempts=p.c.attempts + 1,
                parked_at=sa.func.now(),
            )
        )

    # -- the operator's commands --------------------------------------------------------------

    def list_parked(self, conn: Any, group: str | None, topic: str | None, limit: int) -> list[Any]:
        p = self.parked
        statement = sa.select(p).order_by(p.c.id.desc()).limit(limit)
        statement = _filtered(statement, p, group, topic, None)
        return list(conn.execute(statement).all())

    def show_parked(self, conn: Any, parked_id: int) -> Any:
        return conn.execute(sa.select(self.parked).where(self.parked.c.id == parked_id)).first()

    def parked_by_ids(self, conn: Any, ids: Sequence[int]) -> list[Any]:
        """The parked rows of ``ids``, whole, in id order."""
        p = self.parked
        statement = sa.select(p).where(p.c.id.in_(list(ids))).order_by(p.c.id)
        return list(conn.execute(statement).all()) if ids else []

    def parked_of_message(self, conn: Any, message_id: str) -> list[Any]:
        """Every parked row of the message ``message_id``, of any group (the parked table
        is small: a scan)."""
        p = self.parked
        statement = sa.select(p).where(p.c.message_id == message_id).order_by(p.c.id)
        return list(conn.execute(statement).all())

    def groups(self, conn: Any) -> list[str]:
        """The consumer groups that applied or parked a message here. The inbox table is
        walked one group at a time through its primary key (consumer_group, message_id):
        one index probe per group, however many messages each applied."""
        inbox = f'"{self.spec.schema}"."{self.spec.table}"'
        parked = f'"{self.spec.schema}"."{self.spec.parked_name}"'
        statement = sa.text(
            "WITH RECURSIVE g(name) AS ("
            f" (SELECT consumer_group FROM {inbox} ORDER BY consumer_group LIMIT 1)"
            " UNION ALL"
            f" SELECT (SELECT i.consumer_group FROM {inbox} AS i"
            " WHERE i.consumer_group > g.name ORDER BY i.consumer_group LIMIT 1)"
            " FROM g WHERE g.name IS NOT NULL)"
            " SELECT name FROM g WHERE name IS NOT NULL"
            f" UNION SELECT DISTINCT consumer_group FROM {parked}"
            " ORDER BY 1"
        )
        return [str(name) for name in conn.execute(statement).scalars()]

    def applied(self, conn: Any, message_id: str, groups: Sequence[str]) -> list[Any]:
        """Where each of ``groups`` applied the message ``message_id`` (its inbox rows: the
        topic, partition and offset it was read at, when), through the primary key."""
        i = self.inbox
        statement = (
            sa.select(i)
            .where(i.c.consumer_group.in_(list(groups)), i.c.message_id == message_id)
            .order_by(i.c.consumer_group)
        )
        return list(conn.execute(statement).all()) if groups else []

    def requeue(
        self, conn: Any, ids: Iterable[int] | None, group: str | None, topic: str | None
    ) -> int:
        """Mark parked messages for retry by their group's runner."""
        p = self.parked
        statement = _filtered(
            sa.update(p).where(p.c.status == PARKED), p, group, topic, ids
        ).values(status=RETRY)
        return int(conn.execute(statement).rowcount)

    def requeue_dead_letter(self, conn: Any, letter: DeadLetter) -> bool:
        """Mark the parked row a dead letter stands for for retry, or put it back, marked for
        retry, when it is gone (purged): True when it was put back.

        Raises :class:`~outbox.errors.OutboxError` when the row is gone and the dead letter
        does not carry the value (it was too large to)."""
        p = self.parked
        where = (
            p.c.consumer_group == letter.group,
            p.c.topic == letter.topic,
            p.c.kafka_partition == letter.partition,
            p.c.kafka_offset == letter.offset,
        )
        if letter.value_omitted:
            found = conn.execute(sa.update(p).where(*where).values(status=RETRY)).rowcount
            if not found:
                raise OutboxError(
                    f"the parked row of {letter.topic}[{letter.partition}]@{letter.offset} is "
                    "gone and its dead letter does not carry the value (too large): nothing "
                    "to retry"
                )
            return False
        names = [name for name, _ in letter.headers] or None
        values = [value for _, value in letter.headers] or None
        statement: Any = (
            insert(p)
            .values(
                consumer_group=letter.group,
                message_id=letter.message_id,
                topic=letter.topic,
                kafka_partition=letter.partition,
                kafka_offset=letter.offset,
                key=letter.key,
                value=letter.value,
                header_names=names,
                header_values=values,
                reason=letter.reason,
                error=letter.error[:4000],
                status=RETRY,
            )
            .on_conflict_do_update(constraint=f"{p.name}_record_key", set_={"status": RETRY})
            # xmax is 0 on a row version an INSERT made, not on one an UPDATE made.
            .returning(sa.literal_column("xmax = 0"))
        )
        return bool(conn.execute(statement).scalar_one())

    def purge_parked(
        self, conn: Any, ids: Iterable[int] | None, group: str | None, topic: str | None
    ) -> int:
        p = self.parked
        return int(conn.execute(_filtered(sa.delete(p), p, group, topic, ids)).rowcount)

    def purge_processed(
        self,
        engine: sa.Engine,
        older_than: timedelta,
        *,
        batch_size: int = 5000,
        now: datetime | None = None,
        dry_run: bool = False,
    ) -> int:
        """Delete inbox rows older than ``older_than``, in short transactions of
        ``batch_size`` rows. A duplicate that arrives after its row is gone is applied again:
        see docs/inbox.md, 'Retention', for a safe age."""
        if older_than < timedelta(0):
            raise ConfigError("older_than must not be negative")
        if batch_size <= 0:
            raise ConfigError("batch_size must be positive")
        cutoff = (now or datetime.now(UTC)) - older_than
        t = self.inbox
        if dry_run:
            with engine.connect() as conn:
                count = conn.execute(
                    sa.select(sa.func.count()).where(t.c.processed_at < cutoff)
                ).scalar_one()
                return int(count)
        total = 0
        while True:
            victims = (
                sa.select(t.c.consumer_group, t.c.message_id)
                .where(t.c.processed_at < cutoff)
                .limit(batch_size)
                .with_for_update(skip_locked=True)
            )
            statement = sa.delete(t).where(
                sa.tuple_(t.c.consumer_group, t.c.message_id).in_(victims)
            )
            with engine.begin() as conn:
                deleted = int(conn.execute(statement).rowcount)
            total += deleted
            if deleted < batch_size:
                return total

    def problem(self, engine: sa.Engine) -> str | None:
        """:meth:`check` on a connection of its own."""
        with engine.connect() as conn:
            return self.check(conn)

    def check(self, conn: Any) -> str | None:
        """Why the runner cannot use these tables, or None when it can."""
        found = conn.execute(
            sa.text("SELECT to_regclass(:a) IS NOT NULL AND to_regclass(:b) IS NOT NULL"),
            {"a": self.spec.qualified_name, "b": f"{self.spec.schema}.{self.spec.parked_name}"},
        ).scalar_one()
        if not found:
            return (
                f"inbox tables {self.spec.qualified_name} and {self.spec.parked_name} do not "
                "exist: run `outbox inbox install`"
            )
        return None


def _filtered(statement: Any, table: sa.Table, group: Any, topic: Any, ids: Any) -> Any:
    if group is not None:
        statement = statement.where(table.c.consumer_group == group)
    if topic is not None:
        statement = statement.where(table.c.topic == topic)
    if ids:
        statement = statement.where(table.c.id.in_(list(ids)))
    return statement
