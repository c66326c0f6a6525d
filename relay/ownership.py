"""Shard ownership through PostgreSQL session advisory locks.

Each relay keeps one autocommit connection (it also LISTENs for the commit-time NOTIFY on
it). On it the relay holds a *member* lock, so that relays can count each other in
``pg_locks``, and one lock per shard it owns. A relay that dies loses its connection, and
PostgreSQL drops its locks at once: the other relays take its shards over within one
rebalance interval. TCP keepalives bound how long a silently vanished relay can hold them.

Rebalancing is simple and converges: with ``m`` live members each relay aims at
``ceil(shards / m)``; it lets go of shards above that and tries to lock free ones below it.

A member also holds a *serving* lock while it has shown that it can publish (a take-over
that worked, a batch acknowledged) and nothing has failed since. One whose take-overs keep
failing may step aside (:meth:`step_aside`): leave the members, so that the others' share
grows to cover its shards. It may do so only while another member serves, decided under one
lock that all relays share: so the members never all step aside, and none steps aside on
account of a relay that is failing too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from outbox.schema import SHARD_COUNT, OutboxTableSpec

log = logging.getLogger(__name__)


@dataclass
class ShardOwnership:
    """The shards this relay owns, kept on ``conn`` (autocommit, owned by the caller)."""

    conn: psycopg.Connection
    spec: OutboxTableSpec
    member_number: int
    shard_count: int = SHARD_COUNT
    owned: set[int] = field(default_factory=set)
    joined: bool = False
    _held_off: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._shards_key = self.spec.lock_space("shard")
        self._members_key = self.spec.lock_space("member")
        self._serving_key = self.spec.lock_space("serving")
        #: One key, held only while a relay decides to step aside: decisions go one at a time.
        self._stepping_aside = (self.spec.lock_space("step-aside"), 0)
        self.serving = False
        #: Live members at the last rebalance (this one counted).
        self.member_count = 1

    def join(self) -> None:
        """Take the member lock (counted by everyone's rebalance). Join only when able to
        publish: every member lowers the others' share."""
        if not self.joined:
            self.conn.execute(
                "SELECT pg_advisory_lock(%s, %s)", (self._members_key, self.member_number)
            )
            self.joined = True

    def mark_serving(self) -> None:
        """Say that this member publishes (a take-over worked, a batch was acknowledged)."""
        if self.joined and not self.serving:
            self.conn.execute(
                "SELECT pg_advisory_lock(%s, %s)", (self._serving_key, self.member_number)
            )
            self.serving = True

    def mark_failing(self) -> None:
        """Say that this member does not publish now (a take-over or a batch failed, Kafka is
        out of reach): no other member steps aside on its account."""
        if self.serving:
            self.conn.execute(
                "SELECT pg_advisory_unlock(%s, %s)", (self._serving_key, self.member_number)
            )
            self.serving = False

    def step_aside(self) -> list[int] | None:
        """Leave the members if another member serves: unlock every shard and the member
        lock, so that the others take this relay's share. Returns the shards let go, or None
        (this relay stays: nobody else serves, or another relay is deciding right now)."""
        if not self.joined:
            return None
        got = self.conn.execute(
            "SELECT pg_try_advisory_lock(%s, %s)", self._stepping_aside
        ).fetchone()
        if not (got and got[0]):
            return None
        try:
            if self.others_serving() == 0:
                return None
            self.mark_failing()
            released = self.release_all()
            self.conn.execute(
                "SELECT pg_advisory_unlock(%s, %s)", (self._members_key, self.member_number)
            )
            self.joined = False
            return released
        finally:
            self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", self._stepping_aside)

    def members(self) -> int:
        """Live members, this one counted whether it is one or not (at least 1)."""
        return max(1, self._holders(self._members_key))

    def other_members(self) -> int:
        """Live members other than this relay."""
        return self._holders(self._members_key, others_only=True)

    def others_serving(self) -> int:
        """Members other than this relay that serve."""
        return self._holders(self._serving_key, others_only=True)

    def _holders(self, key: int, others_only: bool = False) -> int:
        """How many sessions hold a lock of the lock space ``key``."""
        row = self.conn.execute(
            "SELECT count(DISTINCT pid) FROM pg_locks "
            "WHERE locktype = 'advisory' AND granted AND objsubid = 2 "
            "AND classid = %s::bigint::oid "
            + ("AND pid <> pg_backend_pid() " if others_only else "")
            + "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (key,),
        ).fetchone()
        return int(row[0]) if row else 0

    def rebalance(
        self,
        can_serve: Callable[[], bool] = lambda: True,
        before_letting_go: Callable[[], None] = lambda: None,
        keep: Callable[[], set[int]] = set,
    ) -> tuple[list[int], list[int]]:
        """Let go of shards above this relay's share, lock free ones below it.

        ``can_serve`` is asked before locking any: a relay that cannot publish right now
        (Kafka out of its reach) takes nothing from relays that can. ``before_letting_go``
        runs before any shard is unlocked: a lost shard must have no batch in flight, so the
        relay finishes its batches there (and only when it has shards to give up). ``keep``,
        asked after it, names shards that may not go yet (a batch of theirs still being
        recorded): fewer shards go then, and the rest at a later rebalance.
        Returns (gained, lost).
        """
        self.member_count = self.members()
        target = math.ceil(self.shard_count / self.member_count)
        kept: set[int] = set()
        if len(self.owned) > target:
            before_letting_go()
            kept = keep()
        lost: list[int] = []
        while len(self.owned) > target and self.owned - kept:
            shard = max(self.owned - kept)
            self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self._shards_key, shard))
            self.owned.discard(shard)
            lost.append(shard)
        gained: list[int] = []
        if len(self.owned) < target:
            now = time.monotonic()
            free = [
                shard
                for shard in self._free_shards()
                if shard not in self.owned and self._held_off.get(shard, 0.0) <= now
            ]
            if free and can_serve():
                # Start at a member-specific shard so that relays starting together collide
                # less; try only as many as the share lacks.
                start = self.member_number % self.shard_count
                free.sort(key=lambda shard: (shard - start) % self.shard_count)
                gained = self._try_lock(free[: target - len(self.owned)])
                self.owned.update(gained)
        return sorted(gained), sorted(lost)

    def _free_shards(self) -> list[int]:
        """The shards no other session holds, in one round trip."""
        rows = self.conn.execute(
            "SELECT s FROM generate_series(0, %s - 1) AS s WHERE s NOT IN ("
            "SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND objsubid = 2 AND classid = %s::bigint::oid AND pid <> pg_backend_pid()"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))",
            (self.shard_count, self._shards_key),
        ).fetchall()
        return [int(row[0]) for row in rows]

    def _try_lock(self, shards: list[int]) -> list[int]:
        """Try each shard's lock, all in one round trip (a pipeline): the shards locked.

        One statement per shard rather than one over all of them, so that exactly the locks
        asked for are taken, whatever plan a single statement would get; a shard another
        relay locked since :meth:`_free_shards` looked is simply not gained.

        If a statement fails, the locks granted before it stay held (session locks ignore the
        rollback) without being recorded: the caller must then end the session, as the relay
        does on any database error (its connection is closed, and every lock goes with it)."""
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

    def release(self, shards: list[int], hold_off: float = 0.0) -> None:
        """Unlock ``shards`` now (a take-over that failed, a producer that cannot go on);
        this relay locks none of them again for ``hold_off`` seconds."""
        until = time.monotonic() + hold_off
        for shard in shards:
            if shard in self.owned:
                self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self._shards_key, shard))
                self.owned.discard(shard)
            if hold_off > 0:
                self._held_off[shard] = until

    def release_all(self) -> list[int]:
        """Unlock every shard (clean shutdown); the connection stays open."""
        released = sorted(self.owned)
        for shard in released:
            self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self._shards_key, shard))
        self.owned.clear()
        return released

    def forget(self) -> list[int]:
        """The connection is gone, and with it every lock: own nothing."""
        lost = sorted(self.owned)
        self.owned.clear()
        self.joined = self.serving = False
        return lost
