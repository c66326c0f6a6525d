"""Shard ownership through PostgreSQL session advisory locks, on the relay's owner session.

Each relay keeps one autocommit connection, its *owner session*. On it the relay holds:

- a *session* lock under a random key, taken when it connects: the relay's other sessions
  (reading, marking) try it before each statement (the ``owner_alive`` query) and touch
  nothing once it is gone, so a relay that lost this session reads and marks nothing more;
- a *member* lock, so that relays can count each other in ``pg_locks``;
- one lock per shard it owns. A relay that dies loses its connection, and PostgreSQL drops
  its locks at once: the other relays take its shards within one rebalance interval. TCP
  keepalives bound how long a silently vanished relay can hold them;
- a *serving* lock while it reaches Kafka (see :mod:`outbox.relay.reach`): another relay
  steps aside only while one serves, decided under one lock that all relays share, so the
  members never all step aside.

Rebalancing is simple and converges: with ``m`` live members each relay aims at
``ceil(shards / m)``; it lets go of idle shards above that (busy ones go at a later
rebalance) and tries to lock free ones below it (:func:`plan_shares` decides, the same for
the model-based test's simulated locks).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg

from outbox.relay.commands import Rebalance, Rebalanced
from outbox.schema import SHARD_COUNT, OutboxTableSpec


@dataclass(frozen=True)
class Shares:
    """What a rebalance does: the shards to unlock, how many to try to lock, and how many
    above the share stay (busy) for a later rebalance."""

    release: tuple[int, ...]
    gain: int
    surplus: int


def plan_shares(owned: int, releasable: Sequence[int], members: int, may_gain: bool) -> Shares:
    """Let go of idle shards above ``ceil(SHARD_COUNT / members)`` (the highest first);
    lock as many free ones as the share lacks when ``may_gain``."""
    target = math.ceil(SHARD_COUNT / max(1, members))
    above = max(0, owned - target)
    release = tuple(sorted(releasable, reverse=True)[:above])
    gain = max(0, target - owned) if may_gain else 0
    return Shares(release, gain, above - len(release))


def free_order(free: Sequence[int], member_number: int) -> list[int]:
    """Free shards in the order a member tries them: from a member-specific shard on, so
    that relays starting together collide less."""
    start = member_number % SHARD_COUNT
    return sorted(free, key=lambda shard: (shard - start) % SHARD_COUNT)


class Leases:
    """The shards this relay owns, its membership and serving lock, on its owner session."""

    def __init__(self, spec: OutboxTableSpec, connect: Callable[[], psycopg.Connection]) -> None:
        self.spec = spec
        self._connect = connect
        self.conn: psycopg.Connection | None = None
        #: The key of the session lock the other sessions look for (0: not connected).
        self.owner_key = 0
        self.member_number = secrets.randbelow(2**31)
        self.owned: set[int] = set()
        self.joined = False
        self.serving = False
        self._held_off: dict[int, float] = {}
        self._shards_key = spec.lock_space("shard")
        self._members_key = spec.lock_space("member")
        self._serving_key = spec.lock_space("serving")
        #: One key, held only while a relay decides to step aside: decisions go one at a time.
        self._stepping_aside = (spec.lock_space("step-aside"), 0)

    # -- the session -------------------------------------------------------------------------

    def connect(self) -> int:
        """Open the owner session and take its session lock; returns the lock's key."""
        conn = self._connect()
        space = self.spec.lock_space("session")
        try:
            while True:
                key = secrets.randbelow(2**31)
                row = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (space, key)).fetchone()
                if row is not None and row[0]:
                    break
        except BaseException:
            conn.close()
            raise
        self.conn, self.owner_key = conn, key
        return key

    @property
    def connected(self) -> bool:
        return self.conn is not None and not self.conn.closed

    def forget(self) -> list[int]:
        """The session is gone (or going), and every lock with it: own nothing."""
        lost = sorted(self.owned)
        self.owned.clear()
        self.joined = self.serving = False
        if self.conn is not None:
            self.conn.close()
        self.conn, self.owner_key = None, 0
        return lost

    # -- what the core asks ------------------------------------------------------------------

    def rebalance(self, command: Rebalance) -> Rebalanced:
        """Join if asked, let go of idle shards above the share, lock free ones below it."""
        if command.join and not self.joined:
            self._execute(
                "SELECT pg_advisory_lock(%s, %s)", (self._members_key, self.member_number)
            )
            self.joined = True
        others = self._holders(self._members_key, others_only=True)
        serving = self._holders(self._serving_key, others_only=True)
        if not self.joined:
            return Rebalanced(joined=False, other_members=others, others_serving=serving)
        shares = plan_shares(len(self.owned), command.releasable, others + 1, command.may_gain)
        self._unlock(shares.release)
        gained: list[int] = []
        if shares.gain:
            now = time.monotonic()
            free = [
                shard
                for shard in self._free_shards()
                if shard not in self.owned and self._held_off.get(shard, 0.0) <= now
            ]
            gained = self._try_lock(free_order(free, self.member_number)[: shares.gain])
            self.owned.update(gained)
        return Rebalanced(
            gained=tuple(sorted(gained)),
            lost=shares.release,
            surplus=shares.surplus,
            joined=True,
            other_members=others,
            others_serving=serving,
        )

    def release(self, shards: Sequence[int], hold_off: float = 0.0) -> None:
        """Unlock ``shards`` now; none of them is locked again for ``hold_off`` seconds."""
        self._unlock([shard for shard in shards if shard in self.owned])
        if hold_off > 0:
            until = time.monotonic() + hold_off
            for shard in shards:
                self._held_off[shard] = until

    def release_all(self) -> list[int]:
        """Unlock every shard (a clean shutdown); the session stays open."""
        released = sorted(self.owned)
        self._unlock(released)
        return released

    def set_serving(self, serving: bool) -> None:
        """Hold the serving lock (this relay reaches Kafka) or let it go."""
        if serving and self.joined and not self.serving:
            self._execute(
                "SELECT pg_advisory_lock(%s, %s)", (self._serving_key, self.member_number)
            )
            self.serving = True
        elif not serving and self.serving:
            self._execute(
                "SELECT pg_advisory_unlock(%s, %s)", (self._serving_key, self.member_number)
            )
            self.serving = False

    def step_aside(self) -> tuple[int, ...] | None:
        """Leave the members if another member serves: unlock every shard and the member
        lock, so that the others take this relay's share. Returns the shards let go, or None
        (this relay stays: nobody else serves, or another relay is deciding right now)."""
        if not self.joined:
            return None
        got = self._execute("SELECT pg_try_advisory_lock(%s, %s)", self._stepping_aside)
        if not got:
            return None
        try:
            if self._holders(self._serving_key, others_only=True) == 0:
                return None
            self.set_serving(False)
            released = self.release_all()
            self._execute(
                "SELECT pg_advisory_unlock(%s, %s)", (self._members_key, self.member_number)
            )
            self.joined = False
            return tuple(released)
        finally:
            self._execute("SELECT pg_advisory_unlock(%s, %s)", self._stepping_aside)

    # -- internals ---------------------------------------------------------------------------

    def _execute(self, sql: str, params: Sequence[object]) -> object:
        assert self.conn is not None
        row = self.conn.execute(sql, params).fetchone()
        return row[0] if row else None

    def _unlock(self, shards: Sequence[int]) -> None:
        if not shards:
            return
        assert self.conn is not None
        with self.conn.pipeline():
            for shard in shards:
                self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self._shards_key, shard))
        self.owned.difference_update(shards)

    def _holders(self, key: int, others_only: bool = False) -> int:
        """How many sessions hold a lock of the lock space ``key``."""
        count = self._execute(
            "SELECT count(DISTINCT pid) FROM pg_locks "
            "WHERE locktype = 'advisory' AND granted AND objsubid = 2 "
            "AND classid = %s::bigint::oid "
            + ("AND pid <> pg_backend_pid() " if others_only else "")
            + "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (key,),
        )
        return int(count) if isinstance(count, int) else 0

    def _free_shards(self) -> list[int]:
        """The shards no other session holds, in one round trip."""
        assert self.conn is not None
        rows = self.conn.execute(
            "SELECT s FROM generate_series(0, %s - 1) AS s WHERE s NOT IN ("
            "SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND objsubid = 2 AND classid = %s::bigint::oid AND pid <> pg_backend_pid()"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))",
            (SHARD_COUNT, self._shards_key),
        ).fetchall()
        return [int(row[0]) for row in rows]

    def _try_lock(self, shards: list[int]) -> list[int]:
        """Try each shard's lock, all in one round trip (a pipeline): the shards locked.

        One statement per shard, so that exactly the locks asked for are taken; a shard
        another relay locked since :meth:`_free_shards` looked is simply not gained. If a
        statement fails, the locks granted before it stay held without being recorded: the
        caller then ends the session (the relay does on any database error)."""
        assert self.conn is not None
        with self.conn.pipeline():
            cursors = [
                self.conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (self._shards_key, s))
                for s in shards
            ]
        locked = []
        for shard, cursor in zip(shards, cursors, strict=True):
            row = cursor.fetchone()
            if row and row[0]:
                locked.append(shard)
        return locked
