"""What can stop a WAL reader, each a one-line error naming what to do.

The server checks (:mod:`outbox.wal.checks`) raise the first three at start; a reader raises
:class:`SlotLost` the moment it finds the slot gone or not the one it was reading, which a
relay turns into recovery from the outbox table (the table is the durable record: whatever
the slot lost is still there).
"""

from __future__ import annotations

from outbox.errors import OutboxError


class WalError(OutboxError):
    """Base class of the WAL source's errors."""


class ServerTooOld(WalError):
    """The server is older than PostgreSQL 15, whose publications have the column lists and
    row filters the outbox's publication is made of."""


class WalLevelNotLogical(WalError):
    """The server does not decode its WAL (``wal_level`` is not ``logical``)."""


class ReplicationNotPermitted(WalError):
    """The role may not read a replication slot (no ``REPLICATION`` attribute, nor
    ``rds_replication`` on Amazon RDS)."""


class NoFreeSlot(WalError):
    """The slot does not exist and every one of ``max_replication_slots`` is taken."""


class NoFreeWalSender(WalError):
    """Every one of ``max_wal_senders`` is streaming to someone already."""


class SlotInUse(WalError):
    """Another session reads the slot (a slot has one reader at a time)."""


class PublicationMismatch(WalError):
    """The publication exists but does not publish what the reader decodes (its table,
    columns, or operations were changed by hand)."""


class UnexpectedStream(WalError):
    """The slot sent something the decoder cannot read as the outbox's publication."""


class SlotLost(WalError):
    """The slot can no longer hand out every message committed since the reader's position.

    ``reason`` is one of :data:`LOST_REASONS`. Nothing is lost from the outbox table: the
    messages committed since ``position`` are all there to be read.
    """

    def __init__(self, text: str, *, slot: str, reason: str, position: int | None) -> None:
        super().__init__(text)
        self.slot = slot
        self.reason = reason
        #: The last position the reader had confirmed (None: it had none yet).
        self.position = position


#: Why a slot is lost: ``dropped`` while read (or gone since), ``missing`` at start (a
#: promoted standby never had it), ``invalidated`` (``max_slot_wal_keep_size``: its WAL was
#: removed), ``recreated`` (a slot of the same name that starts after the reader's position).
LOST_REASONS = ("dropped", "missing", "invalidated", "recreated")
