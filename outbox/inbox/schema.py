"""The inbox tables, declared once for the runner, the migration and the tests.

Two tables per inbox, in the consumer's own database:

- ``<table>``: one row per message a consumer group has applied, keyed by
  ``(consumer_group, message_id)``. Inserting it in the handler's transaction is what makes
  the handler's effects happen once: a second delivery finds the row and is skipped.
- ``<table>_parked``: messages the runner gave up on (a handler that kept failing, a value
  it could not decode, a record without an identity), with the error, for an operator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from outbox.errors import ConfigError
from outbox.validation import validate_identifier

DEFAULT_INBOX_TABLE = "inbox"
DEFAULT_INBOX_SCHEMA = "public"
MAX_INBOX_TABLE_NAME = 40

#: A parked message waits for an operator; ``retry`` asks the runner to apply it again.
PARKED, RETRY = "parked", "retry"

#: Why a message was parked.
HANDLER_FAILED, UNDECODABLE, NO_IDENTITY = "handler", "undecodable", "no-identity"


@dataclass(frozen=True)
class InboxTableSpec:
    """Where the inbox tables live. Names are validated: they are spliced into SQL text."""

    schema: str = DEFAULT_INBOX_SCHEMA
    table: str = DEFAULT_INBOX_TABLE
    metadata: sa.MetaData = field(default_factory=sa.MetaData, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_identifier(self.schema, "inbox schema")
        validate_identifier(self.table, "inbox table")
        if len(self.table) > MAX_INBOX_TABLE_NAME:
            raise ConfigError(f"inbox table name is limited to {MAX_INBOX_TABLE_NAME} characters")

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def parked_name(self) -> str:
        return f"{self.table}_parked"

    @property
    def version_table(self) -> str:
        """The inbox history's Alembic version table, beside the inbox table."""
        return f"{self.table}_alembic_version"

    @cached_property
    def inbox(self) -> sa.Table:
        return build_inbox_table(self.metadata, self.table, self.schema)

    @cached_property
    def parked(self) -> sa.Table:
        return build_parked_table(self.metadata, self.table, self.schema)


def build_inbox_table(metadata: sa.MetaData, table: str, schema: str) -> sa.Table:
    tz = sa.DateTime(timezone=True)
    return sa.Table(
        table,
        metadata,
        sa.Column("consumer_group", sa.Text, primary_key=True),
        # Text, not uuid: fallback identities (topic/partition/offset, a key) are not UUIDs.
        sa.Column("message_id", sa.Text, primary_key=True),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("kafka_partition", sa.Integer, nullable=False),
        sa.Column("kafka_offset", sa.BigInteger, nullable=False),
        sa.Column("processed_at", tz, nullable=False, server_default=sa.func.now()),
        sa.Index(f"{table}_processed_at_idx", "processed_at"),
        schema=schema,
    )


def build_parked_table(metadata: sa.MetaData, table: str, schema: str) -> sa.Table:
    tz = sa.DateTime(timezone=True)
    name = f"{table}_parked"
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
        sa.Column("consumer_group", sa.Text, nullable=False),
        sa.Column("message_id", sa.Text),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("kafka_partition", sa.Integer, nullable=False),
        sa.Column("kafka_offset", sa.BigInteger, nullable=False),
        sa.Column("key", sa.LargeBinary),
        sa.Column("value", sa.LargeBinary),
        sa.Column("header_names", pg.ARRAY(sa.Text)),
        sa.Column("header_values", pg.ARRAY(sa.LargeBinary)),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("status", sa.Text, nullable=False, server_default=PARKED),
        sa.Column("parked_at", tz, nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint(f"status IN ('{PARKED}', '{RETRY}')", name=f"{name}_status_check"),
        # A record read again (a crash before the offset commit) is parked once.
        sa.UniqueConstraint(
            "consumer_group",
            "topic",
            "kafka_partition",
            "kafka_offset",
            name=f"{name}_record_key",
        ),
        schema=schema,
    )
