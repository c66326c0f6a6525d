"""What the relay's core and its adapters say to each other: batches, recordings, events, commands.

The core (:mod:`outbox.relay.core`) is fed *events* (rows read, a batch answered, an outcome
recorded, shards gained, a probe's answer) and answers with *commands* (read these shards,
send this batch, record that outcome, let these shards go). The driver
(:mod:`outbox.relay.driver`) carries the commands out on the adapters (the source, the
sender, the recorder, the leases) and feeds their answers back. Everything here is plain
data: no I/O, no clock.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from outbox.records import OutboxRecord
from outbox.rows import Failure, PendingRow
from outbox.sending import Ack, BatchResult

# -- what is in flight and being recorded ---------------------------------------------------


@dataclass(eq=False)
class Batch:
    """Rows of one or more idle shards, read together and sent as one flight (exactly-once:
    one Kafka transaction per shard). ``failures`` are the rows that cannot be sent at all
    (undecodable): recorded with the batch's outcome."""

    number: int
    rows: list[PendingRow]
    shards: frozenset[int]
    #: When it was sent (the core's clock).
    started: float
    #: One record sent with nothing else on its producer: a refusal is its own.
    isolated: bool = False
    failures: list[Failure] = field(default_factory=list)

    @property
    def records(self) -> list[OutboxRecord]:
        return [row.record for row in self.rows if row.record is not None]


@dataclass(eq=False)
class Recording:
    """An outcome to record: what Kafka took (``acks``) and what failed (``failures``).

    ``shard_of`` names each row's shard: while a row cannot be recorded yet (another
    transaction holds it locked), its shard stays busy. ``batch`` is the batch it records
    (None: the rows a take-over found committed by the shard's last owner).
    """

    number: int
    acks: list[Ack]
    failures: list[Failure]
    shard_of: Mapping[uuid.UUID, int]
    #: When it was first submitted (the core's clock): a mark held by a row lock ages from
    #: here however often it is tried.
    began: float
    batch: Batch | None = None

    @property
    def shards(self) -> frozenset[int]:
        return frozenset(self.shard_of.values())


# -- commands: what the core asks of the adapters -------------------------------------------


@dataclass(frozen=True)
class Read:
    """Read the next rows of ``shards`` that may go now: at most ``size`` in all and
    ``per_shard`` of one shard (answered at once with :class:`RowsRead`)."""

    shards: tuple[int, ...]
    size: int
    per_shard: int


@dataclass(frozen=True)
class Send:
    """Start sending ``batch`` (answered later with :class:`BatchEnded`)."""

    batch: Batch


@dataclass(frozen=True)
class Record:
    """Record ``recording`` (answered later with :class:`Recorded`)."""

    recording: Recording


@dataclass(frozen=True)
class TakeOver:
    """Take ``shards`` over: exactly-once, fence their last owner and read what its last
    transactions committed (answered later with :class:`TakenOver`)."""

    shards: tuple[int, ...]


@dataclass(frozen=True)
class LetGo:
    """Drop the producers of ``shards`` (exactly-once); nothing of them is in flight."""

    shards: tuple[int, ...]


@dataclass(frozen=True)
class Release:
    """Unlock ``shards``; this relay takes none of them again for ``hold_off`` seconds."""

    shards: tuple[int, ...]
    hold_off: float = 0.0


@dataclass(frozen=True)
class Rebalance:
    """Count the members, join them with ``join``, give up ``releasable`` shards above this
    relay's share, lock free ones below it when ``may_gain`` (answered at once with
    :class:`Rebalanced`)."""

    releasable: tuple[int, ...]
    may_gain: bool
    join: bool


@dataclass(frozen=True)
class StepAside:
    """Leave the members if another serves (answered at once with :class:`SteppedAside`)."""


@dataclass(frozen=True)
class Serving:
    """Say (``True``) or unsay that this relay reaches Kafka, for the other relays."""

    serving: bool


@dataclass(frozen=True)
class Probe:
    """Ask a broker whether Kafka is in reach (answered later with :class:`Probed`)."""


@dataclass(frozen=True)
class StopSending:
    """Stop what is in flight where it can be stopped: this relay lost or gave up its
    shards. What Kafka has not acknowledged ends unsent (never reported: its batches are
    forgotten)."""


Command = (
    Read
    | Send
    | Record
    | TakeOver
    | LetGo
    | Release
    | Rebalance
    | StepAside
    | Serving
    | Probe
    | StopSending
)

# -- events: what the adapters tell the core ------------------------------------------------


@dataclass(frozen=True)
class RowsRead:
    read: Read
    rows: Sequence[PendingRow]


@dataclass(frozen=True)
class BatchEnded:
    batch: Batch
    result: BatchResult


@dataclass(frozen=True)
class Recorded:
    """``recording`` is recorded but for the rows ``held`` (another transaction holds them
    locked: to be tried again)."""

    recording: Recording
    held: frozenset[uuid.UUID] = frozenset()


@dataclass(frozen=True)
class TakenOver:
    """The take-over of ``shards`` ended: ``recovered`` holds, per shard, what its last
    owner's committed transactions sent; ``error`` says why it failed (None: it worked)."""

    shards: tuple[int, ...]
    recovered: Mapping[int, Sequence[Ack]] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class Probed:
    reached: bool


@dataclass(frozen=True)
class Rebalanced:
    gained: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    #: Shards this relay owns above its share and could not give up yet (busy).
    surplus: int = 0
    joined: bool = False
    #: Members other than this relay, and how many of them serve.
    other_members: int = 0
    others_serving: int = 0


@dataclass(frozen=True)
class SteppedAside:
    """The shards let go in stepping aside (None: it stayed, nobody else serves)."""

    released: tuple[int, ...] | None


@dataclass(frozen=True)
class Woken:
    """A writer's commit (or the source's own last look before sleeping): rows may be new
    on any shard."""


Event = RowsRead | BatchEnded | Recorded | TakenOver | Probed | Rebalanced | SteppedAside | Woken
