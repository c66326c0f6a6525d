"""Dead-letter topics: a parked record also goes to a topic, through the consumer's outbox.

With ``Inbox(..., dead_letters=DeadLetters(Outbox()))`` every record the runner parks is
also written, **in the transaction that writes its parked row**, as a message to the
record's dead-letter topic (``<topic>.dlq`` unless configured) in the outbox table of the
consumer's own database. The dead letter therefore exists exactly when the parked row does,
and the consumer's relay publishes it like any other message. Its key and value are the
record's; its headers are the record's (those named ``outbox-...`` or ``dlq-...`` carried
as ``dlq-original-<name>``) followed by where it came from and why it was parked::

    inbox = Inbox(
        group="billing",
        dead_letters=DeadLetters(Outbox(), topics={"payments": "billing.payments.failed"}),
    )

See docs/inbox-dead-letters.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from outbox.errors import (
    ConfigError,
    OutboxTableMissing,
    PayloadTooLarge,
    PermissionDenied,
)
from outbox.fingerprints import exception_class
from outbox.inbox.error_text import split_error
from outbox.validation import RESERVED_HEADER_PREFIX, validate_topic

if TYPE_CHECKING:
    from outbox.inbox.api import RawRecord
    from outbox.publisher import Outbox

#: The default dead-letter topic of ``orders`` is ``orders.dlq``.
DEFAULT_SUFFIX = ".dlq"

#: Every header a dead letter adds starts with this.
HEADER_PREFIX = "dlq-"
#: A header of the record whose name the outbox reserves (``outbox-id``), or one that would
#: be taken for a dead letter's own (a dead letter of a dead letter), is carried under this
#: prefix and given its name back when the record is retried from the dead letter.
ORIGINAL_PREFIX = "dlq-original-"

GROUP = "dlq-group"
TOPIC = "dlq-topic"
PARTITION = "dlq-partition"
OFFSET = "dlq-offset"
KEY = "dlq-key"
MESSAGE_ID = "dlq-message-id"
REASON = "dlq-reason"
ERROR_CLASS = "dlq-error-class"
ERROR_MESSAGE = "dlq-error-message"
TRACEBACK = "dlq-traceback"
ATTEMPTS = "dlq-attempts"
PARKED_ID = "dlq-parked-id"
#: Set (to the value's size in bytes) when the value was left out to stay within the outbox's
#: ``max_message_bytes``; such a dead letter can be retried only while its parked row exists.
VALUE_OMITTED = "dlq-value-omitted"


class DeadLetters:
    """Send what the inbox parks to dead-letter topics too, through ``outbox``.

    ``outbox``: an :class:`outbox.Outbox` naming the outbox table in the consumer's own
    database (the one the inbox's tables are in: the dead letter is written with the parked
    row, in one transaction). Only its ``schema``, ``table`` and ``max_message_bytes`` are
    used: values are written as the record's bytes, whatever its serializer, and dead
    letters always go through the relay (never its immediate sender).
    ``topics``: a dead-letter topic per topic, for those that do not take the default.
    ``suffix``: the default dead-letter topic of ``orders`` is ``orders`` + ``suffix``.
    """

    def __init__(
        self,
        outbox: Outbox,
        *,
        topics: Mapping[str, str] | None = None,
        suffix: str = DEFAULT_SUFFIX,
    ) -> None:
        from outbox.publisher import Outbox
        from outbox.serialization import BytesSerializer

        if not isinstance(outbox, Outbox):
            raise ConfigError(
                f"dead letters need an outbox.Outbox on the consumer's database, "
                f"got {type(outbox).__name__}"
            )
        if not isinstance(suffix, str) or not suffix:
            raise ConfigError("the dead-letter suffix must be a non-empty str, e.g. '.dlq'")
        validate_topic(f"t{suffix}")  # InvalidTopic for characters Kafka refuses
        overrides = dict(topics or {})
        for topic, dead_letter_topic in overrides.items():
            validate_topic(topic)
            validate_topic(dead_letter_topic)
            if topic == dead_letter_topic:
                raise ConfigError(f"topic {topic!r} cannot be its own dead-letter topic")
        self.topics: Mapping[str, str] = overrides
        self.suffix = suffix
        self.spec = outbox.spec
        # The record's bytes go as they are: the service's serializer is for its own values.
        self._writer = Outbox(
            schema=outbox.spec.schema,
            table=outbox.spec.table,
            serializer=BytesSerializer(),
            max_message_bytes=outbox.max_message_bytes,
        )

    def topic_for(self, topic: str) -> str:
        """The dead-letter topic of ``topic``."""
        return self.topics.get(topic) or f"{topic}{self.suffix}"

    def check_topics(self, handled: Iterable[str]) -> None:
        """Refuse what cannot work with an inbox reading ``handled``: a dead-letter topic
        configured for a topic the inbox does not read (a typo, most likely), one too long
        for Kafka, or one the inbox reads itself (a parked record would be applied there)."""
        read = set(handled)
        unknown = sorted(set(self.topics) - read)
        if unknown:
            raise ConfigError(
                f"dead-letter topics configured for topics the inbox has no handler for: "
                f"{', '.join(unknown)}"
            )
        for topic in sorted(read):
            dead_letter_topic = validate_topic(self.topic_for(topic))
            if dead_letter_topic in read:
                raise ConfigError(
                    f"the dead-letter topic of {topic!r}, {dead_letter_topic!r}, is read by the "
                    "same inbox: its parked records would be applied there"
                )

    def check_table(self, conn: sa.Connection) -> None:
        """Raise :class:`~outbox.errors.OutboxTableMissing` or
        :class:`~outbox.errors.PermissionDenied` when dead letters cannot be written."""
        name = self.spec.qualified_name
        exists, can_insert = conn.execute(
            sa.text(
                "SELECT t.oid IS NOT NULL, "
                "t.oid IS NOT NULL AND has_table_privilege(t.oid, 'INSERT') "
                "FROM (SELECT to_regclass(:name) AS oid) AS t"
            ),
            {"name": name},
        ).one()
        if not exists:
            raise OutboxTableMissing(
                f"dead letters go through the outbox table {name}, which does not exist in the "
                "consumer's database: run `outbox db upgrade` on it (and run a relay there)"
            )
        if not can_insert:
            raise PermissionDenied(
                f"dead letters go through {name}: the consumer's role needs INSERT on it"
            )

    def write(
        self,
        session: Any,
        group: str,
        record: RawRecord,
        message_id: str | None,
        reason: str,
        error: str,
        attempts: int,
        parked_id: int,
    ) -> None:
        """Add the dead letter of ``record``, parked as ``parked_id``, to ``session``'s
        transaction (a plain ``Session``: the inbox's, inside its transaction)."""
        from outbox.message import NO_KEY

        about = _about(group, record, message_id, reason, error, attempts, parked_id)
        carried = carried_headers(record.headers)
        value = record.value
        # Within max_message_bytes, by leaving out first the value (the parked row keeps
        # it), then the traceback and the record's headers.
        variants = [
            (value, carried + about),
            (None, carried + about + [(VALUE_OMITTED, _size(value))]),
            (None, [h for h in about if h[0] != TRACEBACK] + [(VALUE_OMITTED, _size(value))]),
        ]
        for attempt, (payload, headers) in enumerate(variants):
            try:
                self._writer.publish(
                    session,
                    self.topic_for(record.topic),
                    payload,
                    key=NO_KEY if record.key is None else record.key,
                    headers=headers,
                )
                return
            except PayloadTooLarge:
                if attempt == len(variants) - 1:
                    raise


def carried_headers(headers: Iterable[tuple[str, bytes | None]]) -> list[tuple[str, bytes | None]]:
    """The record's headers as a dead letter carries them (the outbox refuses names it
    reserves; names of the dead letter's own headers would be mistaken for them)."""
    carried = []
    for name, value in headers:
        if name.lower().startswith((RESERVED_HEADER_PREFIX, HEADER_PREFIX)):
            name = ORIGINAL_PREFIX + name
        carried.append((name, value))
    return carried


def _about(
    group: str,
    record: RawRecord,
    message_id: str | None,
    reason: str,
    error: str,
    attempts: int,
    parked_id: int,
) -> list[tuple[str, bytes | None]]:
    """The headers that say where a dead letter came from and why it was parked."""
    summary, frames = split_error(error)
    kind = exception_class(summary, reason)
    text = summary[len(kind) + 1 :].strip() if summary.startswith(f"{kind}:") else summary
    about: list[tuple[str, bytes | None]] = [
        (GROUP, group.encode()),
        (TOPIC, record.topic.encode()),
        (PARTITION, str(record.partition).encode()),
        (OFFSET, str(record.offset).encode()),
    ]
    if record.key is not None:
        about.append((KEY, record.key))
    if message_id is not None:
        about.append((MESSAGE_ID, message_id.encode()))
    about += [
        (REASON, reason.encode()),
        (ERROR_CLASS, kind.encode()),
        (ERROR_MESSAGE, text.encode()),
        (ATTEMPTS, str(attempts).encode()),
        (PARKED_ID, str(parked_id).encode()),
    ]
    if frames is not None:
        about.append((TRACEBACK, frames.encode()))
    return about


def _size(value: bytes | None) -> bytes:
    return str(len(value or b"")).encode()
