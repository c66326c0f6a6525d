"""Every way a row becomes sendable wakes a sleeping relay: one function for all of them.

An insert wakes the relay through the table's trigger (revision 0003): it holds the wake
lock shared until commit and, refused it because a relay sleeps, notifies at commit. A row
made pending or given back by an UPDATE (the immediate sender giving rows back, ``outbox
dead retry``, a prepared message's commit, reconciliation's repair) fires no insert trigger:
the code that runs the UPDATE calls :func:`wake_relays` in the same transaction, which does
what the trigger does. While relays are busy it costs one shared try-lock and no NOTIFY.
"""

from __future__ import annotations

import sqlalchemy as sa

from outbox.queries import Queries

__all__ = ["wake_relays"]


def wake_relays(conn: sa.Connection, queries: Queries) -> None:
    """Have the transaction on ``conn`` wake a sleeping relay when it commits (call it in the
    transaction that made rows sendable; in an autocommit statement after it, it wakes one
    at once, which is as safe: a relay that does not sleep yet looks once more before it
    does)."""
    space, number = queries.spec.wake_lock
    conn.execute(
        queries["wake_relays"],
        {"channel": queries.spec.notify_channel, "wake_space": space, "wake_number": number},
    )
