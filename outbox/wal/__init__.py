"""The WAL source: the outbox's committed messages read from PostgreSQL's logical decoding.

The publish path does not change: messages are outbox rows, inserted in the business
transaction as for the table relay, and the table stays the durable record of what was
committed. A publication on the table (its inserts of pending rows, the columns a relay
sends) and a replication slot named after it hand those rows out in commit order, as they
commit, with no polling and nothing written back per message; a slot that is lost loses
nothing, since every row is still in the table to recover from.

- :class:`WalReader` (:mod:`outbox.wal.reader`): start, read, confirm; heartbeats; a lost
  slot said at once.
- :mod:`outbox.wal.checks`: what the server must allow, each refusal one line.
- :mod:`outbox.wal.slots`: the publication and the slot, their names and their state
  (the WAL held back, for ``outbox status`` and the metrics).
- :mod:`outbox.wal.pgoutput` and :mod:`outbox.wal.stream`: the decoder and the replication
  protocol, the hot path (measured by ``bench/wal_probe.py``).
"""

from outbox.wal.errors import (
    LOST_REASONS,
    NoFreeSlot,
    NoFreeWalSender,
    PublicationMismatch,
    ReplicationNotPermitted,
    ServerTooOld,
    SlotInUse,
    SlotLost,
    UnexpectedStream,
    WalError,
    WalLevelNotLogical,
)
from outbox.wal.pgoutput import Begin, Commit, WalMessage
from outbox.wal.reader import HEARTBEAT_SECONDS, Heartbeat, WalReader
from outbox.wal.slots import SlotState, slot_name, slot_state
from outbox.wal.stream import StreamError

__all__ = [
    "HEARTBEAT_SECONDS",
    "LOST_REASONS",
    "Begin",
    "Commit",
    "Heartbeat",
    "NoFreeSlot",
    "NoFreeWalSender",
    "PublicationMismatch",
    "ReplicationNotPermitted",
    "ServerTooOld",
    "SlotInUse",
    "SlotLost",
    "SlotState",
    "StreamError",
    "UnexpectedStream",
    "WalError",
    "WalLevelNotLogical",
    "WalMessage",
    "WalReader",
    "slot_name",
    "slot_state",
]
