"""From an outbox row to the Kafka record the relay and the immediate sender produce."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from outbox.message import CONTENT_TYPE_HEADER, ID_HEADER

#: Producer settings the outbox always uses: idempotence makes retries duplicate-free and
#: keeps each partition's records in order; acks=all waits for the in-sync replicas.
SAFE_PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "max.in.flight.requests.per.connection": 5,
    "compression.type": "lz4",
    # Sent as soon as produced: a relay or immediate sender produces a whole batch at once,
    # so waiting to fill requests only delays messages (1 ms cost 1.4 ms at p50, measured).
    "linger.ms": 0,
    # A missing topic fails its messages after 5 s (as unknown, a permanent error) instead of
    # waiting out the whole delivery timeout; topics are created ahead, not on the fly.
    "topic.metadata.propagation.max.ms": 5000,
}


# Not frozen, for the cost of building one per message read (see outbox.rows.PendingRow).
@dataclass(slots=True)
class OutboxRecord:
    """A leased outbox row, as much of it as producing needs."""

    id: uuid.UUID
    seq: int
    shard: int
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    #: Bumped each time repair puts the row back to pending (see ``requeue_missing``).
    generation: int = 0

    @property
    def kafka_headers(self) -> list[tuple[str, str | bytes | None]]:
        return list(self.headers)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> OutboxRecord:
        """Build from a result row; raises ValueError for a row whose headers do not decode."""
        return cls.from_columns(
            row["id"],
            row["seq"],
            row["shard"],
            row["topic"],
            row.get("key"),
            row.get("value"),
            row.get("content_type"),
            row.get("header_names"),
            row.get("header_values"),
            row.get("generation"),
            row.get("id_text"),
        )

    @classmethod
    def from_columns(
        cls,
        message_id: uuid.UUID,
        seq: int,
        shard: int,
        topic: str,
        key: object,
        value: object,
        content_type: object,
        names: Sequence[str] | None,
        values: Sequence[bytes | None] | None,
        generation: int | None,
        id_text: str | None = None,
    ) -> OutboxRecord:
        """Build from the row's columns (``id_text``: the id as text, when the query gave it);
        raises ValueError for a row whose headers do not decode."""
        if (names is None) != (values is None) or len(names or ()) != len(values or ()):
            raise ValueError("header_names and header_values differ in length")
        headers: list[tuple[str, bytes | None]] = [
            (ID_HEADER, (id_text or str(message_id)).encode())
        ]
        if content_type is not None:
            if not isinstance(content_type, str):
                raise ValueError("content_type is not text")
            headers.append((CONTENT_TYPE_HEADER, content_type.encode()))
        if names:
            for name, header in zip(names, values or (), strict=True):
                if not isinstance(name, str) or not (header is None or isinstance(header, bytes)):
                    raise ValueError(f"header {name!r} is not (str, bytes)")
                headers.append((name, header))
        return cls(
            id=message_id,
            seq=seq,
            shard=shard,
            topic=topic,
            key=key if key is None or type(key) is bytes else _as_bytes(key),
            value=value if value is None or type(value) is bytes else _as_bytes(value),
            headers=headers,
            generation=int(generation or 0),
        )


def _as_bytes(value: object) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, memoryview | bytearray):
        return bytes(value)
    raise ValueError(f"expected bytes, got {type(value).__name__}")


def producer_config(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The safe defaults with the caller's settings on top (``bootstrap.servers`` at least)."""
    config = {**SAFE_PRODUCER_DEFAULTS, **overrides}
    if "bootstrap.servers" not in config:
        from outbox.errors import ConfigError

        raise ConfigError("the Kafka producer needs bootstrap.servers")
    return config
