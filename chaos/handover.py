"""How long shards go without an owner: the relays' handover, watched from outside.

A thread looks at ``pg_locks`` every ``interval`` seconds on a connection of its own (straight
to PostgreSQL, past the fault proxy) and counts the shard locks held. Each stretch with fewer
than every shard owned is a *gap*, and so, shard by shard, is each stretch a shard spends
without an owner (a *shard gap*: several shards ownerless one after the other, as faults
overlap, make one long gap of short shard gaps); after the run each gap is put down to the
fault that was
last injected when it opened, and to whether it opened while that fault held or after its
heal: a relay killed with -9 gives the time until the survivors own its shards, its restart
(after the heal) the time until the shards the others let go for it are taken.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.schema import SHARD_COUNT, OutboxTableSpec

#: Seconds between two looks at the locks.
INTERVAL = 0.1


@dataclass(frozen=True)
class Gap:
    """Run time (s) at which fewer than every shard was owned, and when all were again."""

    opened: float
    closed: float | None  # None: still open when the watch stopped

    @property
    def seconds(self) -> float | None:
        return None if self.closed is None else self.closed - self.opened


class ShardWatch:
    """Records the gaps in shard ownership while it runs; ``clock`` gives the run's time."""

    def __init__(
        self,
        conninfo: str,
        clock: Callable[[], float],
        spec: OutboxTableSpec | None = None,
        interval: float = INTERVAL,
    ) -> None:
        self.conninfo = conninfo
        self.clock = clock
        self.shard_space = (spec or OutboxTableSpec()).lock_space("shard")
        self.interval = interval
        self.gaps: list[Gap] = []
        self.shard_gaps: list[Gap] = []
        self._opened: float | None = None
        self._shard_opened: dict[int, float] = {}
        self._looked = False  # at the locks once at least
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shard-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every shard to be owned (a hand-over still under
        way when the run ends is timed, not cut short); whether they all are."""
        deadline = time.monotonic() + timeout
        while self._opened is not None or self._shard_opened or not self._looked:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(self.interval)
        return True

    def stop(self) -> list[Gap]:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(10)
        if self._opened is not None:
            self.gaps.append(Gap(self._opened, None))
            self._opened = None
        self.shard_gaps += [Gap(opened, None) for opened in self._shard_opened.values()]
        self._shard_opened.clear()
        return self.gaps

    def _watch(self) -> None:
        conn: psycopg.Connection | None = None
        while not self._stop.wait(self.interval):
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=2)
                owned = self._owned(conn)
            except psycopg.Error:
                # PostgreSQL is down (a restart fault): every lock went with it. The gap is
                # seen, and timed, once it answers again.
                if conn is not None:
                    conn.close()
                conn = None
                continue
            self._saw(owned)
        if conn is not None:
            conn.close()

    def _owned(self, conn: psycopg.Connection) -> frozenset[int]:
        rows = conn.execute(
            "SELECT DISTINCT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND objsubid = 2 AND classid = %s::bigint::oid"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (self.shard_space,),
        ).fetchall()
        return frozenset(int(row[0]) for row in rows)

    def _saw(self, owned: frozenset[int]) -> None:
        now = self.clock()
        self._looked = True
        if len(owned) < SHARD_COUNT and self._opened is None:
            self._opened = now
        elif len(owned) >= SHARD_COUNT and self._opened is not None:
            self.gaps.append(Gap(self._opened, now))
            self._opened = None
        for shard in range(SHARD_COUNT):
            opened = self._shard_opened.get(shard)
            if shard not in owned and opened is None:
                self._shard_opened[shard] = now
            elif shard in owned and opened is not None:
                self.shard_gaps.append(Gap(opened, now))
                del self._shard_opened[shard]


#: A fault injected this soon after Kafka came back shares its gaps with Kafka's aftermath
#: (partition leaders and transaction coordinators still loading): they are reported apart.
AFTERMATH = 5.0
#: Faults after whose heal Kafka has an aftermath: a broker restarted (or an overlap with one).
KAFKA_RESTARTS = ("broker_restart", "brokers_down")


def healed_at(fault: dict[str, Any]) -> float:
    """Run time at which ``fault`` healed: as logged when known (a broker restart heals once
    the broker serves again, often well past its hold), else its injection time plus hold."""
    healed = fault.get("healed")
    return float(healed) if healed is not None else fault["t"] + fault.get("hold", 0.0)


def attribute(gap: Gap, faults: list[dict[str, Any]]) -> str:
    """What ``gap`` is put down to: the fault last injected before it opened, and whether it
    opened while that fault held or after its heal ("<kind>, after the heal"); a fault that
    landed under :data:`AFTERMATH` seconds after a broker restart healed says so
    ("<kind>, under 5 s after <previous kind>"). "start" before any fault."""
    before = [fault for fault in faults if fault["t"] <= gap.opened]
    if not before:
        return "start"
    last = before[-1]
    kind = str(last["kind"])
    previous = before[-2] if len(before) > 1 else None
    if previous and _restarts_kafka(previous) and last["t"] - healed_at(previous) < AFTERMATH:
        kind += f", under {AFTERMATH:.0f} s after {previous['kind']}"
    # Past the heal (plus the watch's own interval) the gap is the aftermath: a restarted
    # relay joining, the others letting shards go for it.
    if gap.opened > healed_at(last) + 2 * INTERVAL:
        kind += ", after the heal"
    return kind


def _restarts_kafka(fault: dict[str, Any]) -> bool:
    parts = fault.get("parts") or [fault]
    return any(part["kind"] in KAFKA_RESTARTS for part in parts)


def by_fault(gaps: list[Gap], faults: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fault kind (as :func:`attribute` puts each gap down): how many gaps, their p50 and
    longest, and how many never closed. ``faults`` are the fault log's entries (their ``t``,
    the run time at which each was injected, ``hold``, and ``healed`` when logged, in
    order)."""
    found: dict[str, list[Gap]] = {}
    for gap in gaps:
        found.setdefault(attribute(gap, faults), []).append(gap)
    figures: dict[str, dict[str, Any]] = {}
    for kind, kind_gaps in sorted(found.items()):
        closed = sorted(s for g in kind_gaps if (s := g.seconds) is not None)
        figures[kind] = {
            "gaps": len(kind_gaps),
            "p50_s": round(statistics.median(closed), 2) if closed else None,
            "max_s": round(closed[-1], 2) if closed else None,
            "never_closed": len(kind_gaps) - len(closed),
        }
    return figures


def gap_lines(watch: ShardWatch, faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every gap as a JSON-ready line: whole-table gaps and shard gaps, with their times
    and what each is put down to."""
    lines = []
    for what, gaps in (("all shards", watch.gaps), ("a shard", watch.shard_gaps)):
        for gap in gaps:
            seconds = gap.seconds
            lines.append(
                {
                    "gap": what,
                    "opened_t": round(gap.opened, 2),
                    "closed_t": None if gap.closed is None else round(gap.closed, 2),
                    "seconds": None if seconds is None else round(seconds, 2),
                    "after": attribute(gap, faults),
                }
            )
    return sorted(lines, key=lambda line: (line["opened_t"], line["gap"]))
