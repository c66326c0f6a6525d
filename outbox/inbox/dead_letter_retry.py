"""Retrying a parked message from its dead letter, a record of a dead-letter topic.

A dead letter's headers say which consumer group parked which record (topic, partition,
offset) under which message id, and it carries the record's key, value and headers. Retrying
from it marks that parked row for retry, as ``outbox inbox parked retry ID`` does; when the
row is gone (purged), the dead letter puts it back, marked for retry. The group's consumer
then applies it through the inbox: a message applied meanwhile is only removed again, so a
dead letter retried twice, or after its parked row was retried, applies nothing twice.

::

    letter = DeadLetter.from_record(record.key(), record.value(), record.headers())
    with engine.begin() as conn:
        InboxStore(InboxTableSpec()).requeue_dead_letter(conn, letter)

or ``outbox inbox parked retry --dead-letter orders.dlq:0:42``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from outbox.errors import ConfigError, OutboxError
from outbox.inbox import dead_letters as h


class NotADeadLetter(OutboxError, ValueError):
    """A record lacks the headers of an inbox's dead letter (or one of them is malformed)."""


@dataclass(frozen=True)
class DeadLetter:
    """What a dead letter says of the record it stands for."""

    group: str
    topic: str
    partition: int
    offset: int
    message_id: str | None
    key: bytes | None
    #: None when the record had none, or when it was left out (``value_omitted``).
    value: bytes | None
    #: The record's headers, with the names the dead letter carried them under given back.
    headers: tuple[tuple[str, bytes | None], ...]
    reason: str
    error: str
    #: The value was too large to go with the dead letter: only the parked row has it.
    value_omitted: bool

    @classmethod
    def from_record(
        cls,
        key: bytes | None,
        value: bytes | None,
        headers: Iterable[tuple[str, bytes | None]] | None,
    ) -> DeadLetter:
        """Read a dead letter (a Kafka record of a dead-letter topic); raises
        :class:`NotADeadLetter` when it is none."""
        found: dict[str, bytes | None] = {}
        original: list[tuple[str, bytes | None]] = []
        for name, header in headers or ():
            if name.startswith(h.ORIGINAL_PREFIX):
                original.append((name[len(h.ORIGINAL_PREFIX) :], header))
            elif name.startswith(h.HEADER_PREFIX):
                found[name] = header
            elif not name.lower().startswith("outbox-"):  # the dead letter's own outbox-id
                original.append((name, header))

        def text(name: str, required: bool = True) -> str | None:
            raw = found.get(name)
            if raw is None:
                if required:
                    raise NotADeadLetter(f"not a dead letter of an inbox: no {name} header")
                return None
            return raw.decode("utf-8", errors="replace")

        group, topic, reason = text(h.GROUP) or "", text(h.TOPIC) or "", text(h.REASON) or ""
        place = (text(h.PARTITION) or "", text(h.OFFSET) or "")
        try:
            partition, offset = int(place[0]), int(place[1])
        except ValueError:
            raise NotADeadLetter(f"{h.PARTITION} and {h.OFFSET} must be integers") from None
        error = text(h.ERROR_MESSAGE, required=False) or ""
        kind = text(h.ERROR_CLASS, required=False)
        summary = f"{kind}: {error}" if kind and error else (kind or error)
        frames = text(h.TRACEBACK, required=False)
        return cls(
            group=group,
            topic=topic,
            partition=partition,
            offset=offset,
            message_id=text(h.MESSAGE_ID, required=False),
            key=key,
            value=value,
            headers=tuple(original),
            reason=reason,
            error=f"{summary}\n{frames}" if frames else summary,
            value_omitted=h.VALUE_OMITTED in found,
        )

    @classmethod
    def from_message(cls, message: Any) -> DeadLetter:
        """Read a dead letter an inbox handler got (an :class:`~outbox.inbox.InboxMessage`)."""
        return cls.from_record(message.key, message.raw_value, message.headers)


def parse_coordinates(text: str) -> tuple[str, int, int]:
    """``"orders.dlq:0:42"`` -> ``("orders.dlq", 0, 42)``."""
    topic, _, rest = text.rpartition(":")
    topic, _, partition = topic.rpartition(":")
    try:
        if not topic:
            raise ValueError
        return topic, int(partition), int(rest)
    except ValueError:
        raise ConfigError(f"{text!r} is not TOPIC:PARTITION:OFFSET") from None


def read_dead_letter(
    kafka: dict[str, Any], topic: str, partition: int, offset: int, timeout: float = 30.0
) -> DeadLetter:
    """The dead letter at ``topic``/``partition``/``offset``, read from Kafka (``kafka``: the
    client settings, with ``bootstrap.servers``). Commits nothing."""
    import time

    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            **kafka,
            "group.id": f"outbox-dead-letter-reader-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = consumer.poll(1.0)
            if record is None:
                continue
            error = record.error()
            if error is not None:
                if error.fatal():
                    raise OutboxError(f"reading {topic}[{partition}]@{offset}: {error}")
                continue
            if record.offset() != offset:
                raise OutboxError(
                    f"no record at {topic}[{partition}]@{offset} (the next one is at "
                    f"{record.offset()}: deleted by retention, or a transaction marker)"
                )
            raw = record.headers() or []
            pairs = raw.items() if isinstance(raw, dict) else raw
            headers = [(name, _bytes(value)) for name, value in pairs]
            return DeadLetter.from_record(record.key(), record.value(), headers)
        raise OutboxError(f"no record read at {topic}[{partition}]@{offset} within {timeout}s")
    finally:
        consumer.close()


def _bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value
