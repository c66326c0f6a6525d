"""What an operator does to parked inbox messages: see them grouped by cause, retry or purge
them.

One implementation for both faces: ``outbox inbox parked ...`` and the dashboard
(:mod:`outbox.dashboard`) call these functions. Each takes a connection in the caller's
transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import sqlalchemy as sa

from outbox.failed_rows import parked_rows
from outbox.fingerprints import ReasonGroup, group_by_reason, ids_of_reason
from outbox.inbox.store import InboxStore

#: The store's methods of the two bulk actions on parked messages.
ParkedAction = Literal["requeue", "purge_parked"]


def parked_groups(
    conn: sa.Connection, store: InboxStore, group: str | None = None, topic: str | None = None
) -> list[ReasonGroup[int]]:
    """The parked messages waiting for an operator (of ``group`` and ``topic``, if given)
    grouped by cause, the largest group first: the groups of ``parked list --by-reason``."""
    return group_by_reason(parked_rows(conn, store.spec, group, topic))


def act_on_parked(
    conn: sa.Connection,
    store: InboxStore,
    action: ParkedAction,
    *,
    ids: Sequence[int] | None = None,
    group: str | None = None,
    topic: str | None = None,
    reason: str | None = None,
) -> int:
    """Hand parked messages back to their group's consumer (``requeue``: it applies them, or
    parks them again, between two batches) or delete them (``purge_parked``): those named by
    ``ids``, of ``group`` and ``topic``, of the cause ``reason`` names (a fingerprint or an
    unambiguous prefix of one), or every one when nothing narrows them. Returns how many."""
    chosen: list[int] | None = list(ids) if ids else None
    if reason is not None:
        chosen = ids_of_reason(parked_rows(conn, store.spec, group, topic), reason)
        if not chosen:
            return 0
    if action == "requeue":
        return store.requeue(conn, chosen, group, topic)
    return store.purge_parked(conn, chosen, group, topic)
