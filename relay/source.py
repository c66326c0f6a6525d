"""Where the relay's messages come from, and where what became of them is recorded.

The loop knows its source only through :class:`MessageSource`: it asks for the next messages
of the shards it owns, and records what Kafka answered; ordering (one batch of a shard in
flight), ownership (the shards' advisory locks on the owner session), sending (the producers)
and recording in the background (the marking sessions) are the loop's, whatever the source.
The one source today is the outbox table (:class:`~outbox.relay.store.RelayStore`); docs/relay.md
("Another source") says how one reading PostgreSQL's logical decoding would plug in here.

What every source must keep, since the loop's guarantees stand on it:

- **Order.** ``read_batch`` returns, for each shard asked, the next messages that may go now,
  each key's in its order; a key whose earliest unsent message cannot go yet (backing off, held
  by an immediate sender) is held back from that message on. A message read is read again
  (by this relay or the shard's next owner) until its outcome is recorded, and never after.
- **Ownership.** Reads and records name the owner session (``owner_key``) and do nothing once
  that session, with its shards' locks, is gone: a relay that lost its shards reads and
  records nothing over their next owner. (A take-over's ``mark_committed`` needs no owner:
  it records only what Kafka holds committed.)
- **Recording.** What a record cannot record yet (another transaction holds the row) it
  returns, to be tried again, and those messages' shards stay busy meanwhile. A failure
  (retry later, dead) is durable when its record returns, and holds its key back as
  ``read_batch`` says; a sent mark may be lost in a crash at-least-once (the message is
  then sent again), never recorded for a message Kafka does not hold.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from typing import Protocol

import psycopg

from outbox.relay.observability import RelayMetrics
from outbox.relay.store import Failure, HeldRow, PendingRow
from outbox.sending import Ack


class MessageSource(Protocol):
    """What the relay loop asks of the source of its messages (see the module's rules)."""

    def count_into(self, metrics: RelayMetrics) -> None:
        """Count what the source itself observes into the relay's ``metrics`` (called once,
        by the relay that reads from it)."""

    # -- reading (outbox.relay.reading, outbox.relay.sleeping) -----------------------------

    def before_read(
        self, shards: Collection[int], session: psycopg.Connection, owner_key: int | None
    ) -> None:
        """Make ready what falls due with time alone (scheduled messages), before a read."""

    def read_batch(
        self,
        shards: Sequence[int],
        batch_size: int,
        connection: psycopg.Connection | None = None,
        per_shard: int | None = None,
        owner_key: int | None = None,
    ) -> list[PendingRow]:
        """The next messages of ``shards`` that may go now, each key's in order: at most
        ``batch_size`` in all and ``per_shard`` of one shard."""
        ...

    def leases_held(self, shards: Sequence[int], connection: psycopg.Connection) -> bool:
        """Whether an immediate sender holds messages of ``shards`` (they go without a
        commit that wakes the relay)."""
        ...

    def sleep_bound(self, timeout: float) -> float:
        """``timeout``, cut to when the next message falls due with time alone."""
        ...

    # -- recording (outbox.relay.marking) --------------------------------------------------

    def mark_acked(
        self, acks: Sequence[Ack], connection: psycopg.Connection, owner_key: int | None
    ) -> None:
        """Record ``acks`` as sent."""

    def mark_unlocked(
        self, acks: Sequence[Ack], connection: psycopg.Connection, owner_key: int | None
    ) -> list[HeldRow]:
        """Record those of ``acks`` nothing else holds, waiting for nothing; returns the
        messages left for a later try."""
        ...

    def record_unlocked(
        self,
        acks: Sequence[Ack],
        failures: Sequence[Failure],
        connection: psycopg.Connection,
        owner_key: int | None,
    ) -> list[tuple[uuid.UUID, int, int | None]]:
        """Record ``acks`` and ``failures`` of the messages nothing else holds, waiting for
        nothing; returns those left (id, shard, the holder's pid or None)."""
        ...

    def record_outcome(
        self,
        acks: Sequence[Ack],
        failures: Sequence[Failure] = (),
        released: Sequence[uuid.UUID] = (),
        connection: psycopg.Connection | None = None,
        owner_key: int | None = None,
    ) -> None:
        """Record ``acks`` and ``failures`` in one transaction (messages that cannot be
        decoded are recorded dead this way, on the owner session)."""
        ...

    # -- taking shards over (outbox.relay.rebalancing) -------------------------------------

    def mark_committed(self, acks: Sequence[Ack]) -> int:
        """Exactly-once: record as sent what the shards' last owner committed to Kafka."""
        ...

    def break_leases(self, shards: Sequence[int]) -> int:
        """A new owner of ``shards`` frees what earlier relays left leased."""
        ...

    # -- sessions and gauges ---------------------------------------------------------------

    def owner_alive(self, session: psycopg.Connection, owner_key: int) -> bool:
        """Whether ``session`` sees the owner session of ``owner_key`` alive."""
        ...

    def oldest_pending_age(self) -> float:
        """Seconds the oldest message not sent yet has waited."""
        ...

    def refresh_gauges(self) -> None:
        """Update the source's own gauges (scheduled messages waiting, overdue)."""

    def close(self) -> None:
        """Let go of what the source holds."""
