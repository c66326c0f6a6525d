"""The outbox table, declared once for the API, the relay, the migrations and the tests."""

from __future__ import annotations

import uuid
import zlib
from dataclasses import dataclass, field
from functools import cached_property

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from outbox.validation import validate_identifier

DEFAULT_TABLE = "outbox"
DEFAULT_SCHEMA = "public"

#: Messages are spread over this many shards by key; each relay instance owns a subset of them,
#: and in exactly-once mode each shard has a transactional producer of its own.
#: Fixed for the life of a table: changing it would move keys between shards.
SHARD_COUNT = 16

#: Table names leave room for the suffixes of the indexes and functions derived from them.
MAX_TABLE_NAME = 40

PENDING, SENT, DEAD = "pending", "sent", "dead"
#: A prepared message waits, invisible to the relay, for its producer (or a check-back) to
#: commit it (it becomes pending) or roll it back (rolled_back, final): see
#: docs/prepared-messages.md.
PREPARED, ROLLED_BACK = "prepared", "rolled_back"
#: A scheduled message waits, invisible to the relay, for its ``deliver_at``: the relay that
#: owns its shard then makes it pending (it takes its place in its key's order then); one
#: cancelled before that is never sent (cancelled, final): see docs/scheduled.md.
SCHEDULED, CANCELLED = "scheduled", "cancelled"

#: Tighter per-table autovacuum settings for the outbox table, measured against PostgreSQL's
#: defaults by ``bench/table_health.py``: every message is inserted and then updated (or
#: deleted) once, so dead tuples and stale pending-index entries come at the message rate.
PENDING_AUTOVACUUM: dict[str, float | int] = {
    "autovacuum_vacuum_scale_factor": 0.01,
    "autovacuum_vacuum_threshold": 1000,
    "autovacuum_vacuum_insert_scale_factor": 0.01,
    "autovacuum_analyze_scale_factor": 0.02,
}
STATUSES = (PENDING, SENT, DEAD, PREPARED, ROLLED_BACK, SCHEDULED, CANCELLED)


def shard_of(key: bytes | None, message_id: uuid.UUID) -> int:
    """The shard of a message: by key, so one key's messages stay in one shard, in order.

    Messages without a key have no order to keep and spread by their id.
    """
    return zlib.crc32(key if key is not None else message_id.bytes) % SHARD_COUNT


@dataclass(frozen=True)
class OutboxTableSpec:
    """Where the outbox table lives. Names are validated: they are spliced into SQL text."""

    schema: str = DEFAULT_SCHEMA
    table: str = DEFAULT_TABLE
    metadata: sa.MetaData = field(default_factory=sa.MetaData, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_identifier(self.schema, "outbox schema")
        validate_identifier(self.table, "outbox table")
        if len(self.table) > MAX_TABLE_NAME:
            from outbox.errors import ConfigError

            raise ConfigError(f"outbox table name is limited to {MAX_TABLE_NAME} characters")

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def notify_channel(self) -> str:
        """The channel a commit-time NOTIFY wakes relays on (one per table)."""
        return f"outbox_{self.schema}_{self.table}"

    @property
    def notify_rule(self) -> str:
        """The NOTIFY rule of revision 0001 (replaced by the wake trigger in 0003)."""
        return f"{self.table}_notify"

    def lock_space(self, purpose: str) -> int:
        """A positive int4 naming this table's advisory locks of one purpose."""
        return zlib.crc32(f"outbox:{purpose}:{self.qualified_name}".encode()) & 0x7FFFFFFF

    @property
    def owner_session_keys(self) -> dict[str, int]:
        """The lock space the ``owner_alive`` query names: an owner session locks its own
        random key (``owner_key``) in it when it connects."""
        return {"session_space": self.lock_space("session")}

    @property
    def wake_lock(self) -> tuple[int, int]:
        """The advisory lock that says whether a commit must wake a relay.

        Writers hold it shared (``pg_try_advisory_xact_lock_shared``) from their first insert
        to their commit; a relay with nothing to do holds it exclusively while it sleeps. A
        writer refused the shared hold knows a relay is asleep and notifies at commit.
        """
        return (self.lock_space("wake"), 0)

    @property
    def sleeper_lock(self) -> tuple[int, int]:
        """Held by the one relay that takes the wake lock for all the idle relays."""
        return (self.lock_space("wake"), 1)

    @property
    def wake_function(self) -> str:
        return f"{self.table}_wake"

    @property
    def retry_index(self) -> str:
        return f"{self.table}_retry_idx"

    @property
    def lease_index(self) -> str:
        return f"{self.table}_lease_idx"

    @property
    def idempotency_index(self) -> str:
        return f"{self.table}_idempotency_key_idx"

    @property
    def prepared_index(self) -> str:
        return f"{self.table}_prepared_idx"

    @property
    def scheduled_index(self) -> str:
        return f"{self.table}_scheduled_idx"

    @property
    def version_table(self) -> str:
        """Alembic's version table for the outbox's own migration history."""
        return f"{self.table}_alembic_version"

    @cached_property
    def table_obj(self) -> sa.Table:
        return build_table(self.metadata, self.table, self.schema)


def build_table(metadata: sa.MetaData, name: str, schema: str) -> sa.Table:
    """Declare the outbox table on ``metadata``."""
    tz = sa.DateTime(timezone=True)
    return sa.Table(
        name,
        metadata,
        # Time-ordered UUIDv7, made by the publisher; sent to Kafka as the `outbox-id` header.
        sa.Column("id", sa.Uuid(as_uuid=True), primary_key=True),
        # Insert order: the relay publishes one shard's messages in this order.
        sa.Column("seq", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("shard", sa.SmallInteger, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("key", sa.LargeBinary),
        sa.Column("value", sa.LargeBinary),
        sa.Column("content_type", sa.Text),
        # User headers only, as two parallel arrays; NULL (the cheap case) when there are none.
        sa.Column("header_names", pg.ARRAY(sa.Text)),
        sa.Column("header_values", pg.ARRAY(sa.LargeBinary)),
        sa.Column("idempotency_key", sa.Text),
        sa.Column("status", sa.Text, nullable=False, server_default=PENDING),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_attempt_at", tz),
        # A sender (relay or immediate send) that took the row holds it until lease_until.
        sa.Column("lease_owner", sa.Text),
        sa.Column("lease_until", tz),
        sa.Column("error_kind", sa.Text),
        sa.Column("last_error", sa.Text),
        sa.Column("created_at", tz, nullable=False, server_default=sa.func.now()),
        sa.Column("sent_at", tz),
        sa.Column("kafka_partition", sa.Integer),
        sa.Column("kafka_offset", sa.BigInteger),
        # Bumped each time repair puts a sent row back to pending; an exactly-once progress
        # record vouches only for the generation it sent.
        sa.Column("generation", sa.Integer, nullable=False, server_default="0"),
        # Prepared messages (revision 0004): when the message was prepared (NULL for a plain
        # one), the name its checker is registered under, when it is checked next, every check
        # (count, time, answer, error) and how it ended (committed or rolled back, when, by
        # whom: producer, check, expired, operator). check_failures (revision 0007): the checks
        # among check_count whose checker raised or timed out.
        sa.Column("prepared_at", tz),
        sa.Column("check_group", sa.Text),
        sa.Column("next_check_at", tz),
        sa.Column("check_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("check_failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_checked_at", tz),
        sa.Column("last_check_answer", sa.Text),
        sa.Column("last_check_error", sa.Text),
        sa.Column("resolved_at", tz),
        sa.Column("resolved_by", sa.Text),
        # Scheduled messages (revision 0010): when the message may be sent, NULL for one sent
        # as soon as it can be.
        sa.Column("deliver_at", tz),
        # Rolled-back prepared messages (revision 0011): the idempotency key the rollback gave
        # up, so that a commit after the rollback can tell whether a retry took it since.
        sa.Column("released_idempotency_key", sa.Text),
        sa.CheckConstraint(
            "status IN ('pending', 'sent', 'dead', 'prepared', 'rolled_back', 'scheduled',"
            " 'cancelled')",
            name=f"{name}_status_check",
        ),
        # Only pending rows are indexed for the relay's scan, so it stays small however many
        # sent rows pile up.
        sa.Index(
            f"{name}_pending_idx",
            "shard",
            "seq",
            postgresql_where=sa.text("status = 'pending'"),
        ),
        # Pending rows that failed at least once (few): the relay passes over the keys that
        # are backing off through it.
        sa.Index(
            f"{name}_retry_idx",
            "shard",
            "topic",
            "key",
            "seq",
            postgresql_where=sa.text("status = 'pending' AND next_attempt_at IS NOT NULL"),
        ),
        # Pending rows leased to an immediate sender (few): the relay passes over them and the
        # later rows of their keys without counting them in a shard's read window.
        sa.Index(
            f"{name}_lease_idx",
            "shard",
            "topic",
            "key",
            "seq",
            postgresql_where=sa.text("status = 'pending' AND lease_until IS NOT NULL"),
        ),
        # Prepared rows only (few), by check group in the order the check-back runners take
        # them: a runner's claim reads its own groups' due rows, not every group's.
        sa.Index(
            f"{name}_prepared_idx",
            "check_group",
            "next_check_at",
            postgresql_where=sa.text("status = 'prepared'"),
        ),
        # Scheduled rows only, by shard in the order they fall due: the relay's promotion
        # reads the due end of its shards' entries, however many lie further ahead.
        sa.Index(
            f"{name}_scheduled_idx",
            "shard",
            "deliver_at",
            "seq",
            postgresql_where=sa.text("status = 'scheduled'"),
        ),
        sa.Index(
            f"{name}_idempotency_key_idx",
            "idempotency_key",
            unique=True,
            postgresql_where=sa.text("idempotency_key IS NOT NULL"),
        ),
        schema=schema,
    )


DEFAULT_SPEC = OutboxTableSpec()
