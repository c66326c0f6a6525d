"""The fault schedule: a pure function of the seed and the profile, so a run can be repeated.

Faults run one after another: each starts ``gap`` seconds after the previous one healed, so
the fault log says which fault a symptom belongs to. The first faults of every schedule are one
of each kind, in an order drawn from the seed, so even the short profile exercises all of them.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from typing import Any

RELAY_KILL = "relay_kill"  # kill -9 one relay, restart it after the hold
RELAY_TERM = "relay_term"  # SIGTERM one relay (it drains), restart it after the hold
# Stop a Kafka broker (SIGTERM or kill -9), start it again. On a cluster, the node that leads
# most of the workload's partitions, or the one coordinating most of the relays' transactions
# (at-least-once: the consumers' group), as found when the fault lands.
BROKER_RESTART = "broker_restart"
# A cluster's two nodes stopped at once (SIGTERM or kill -9), both started again: below
# ``min.insync.replicas``, so writes to Kafka stall until then.
BROKERS_DOWN = "brokers_down"
POSTGRES_RESTART = "postgres_restart"  # stop PostgreSQL (fast, or immediate = crash), start it
# The network faults hit every connection of the relays and the consumers to the broker.
NET_LATENCY = "net_latency"  # traffic delayed by ``latency_ms`` per chunk
NET_DROP = "net_drop"  # every connection reset; new ones refused for the hold
NET_STALL = "net_stall"  # connections stay open but no byte moves for the hold
CONSUMER_KILL = "consumer_kill"  # kill -9 one inbox consumer, restart it after the hold
CONSUMER_TERM = "consumer_term"  # SIGTERM one inbox consumer (it drains), restart it
WRITER_KILL = "writer_kill"  # kill -9 one writer process (often mid-transaction), restart it
# The database faults hit every connection of the relays to PostgreSQL (and no one else's).
DB_LATENCY = "db_latency"  # traffic delayed by ``latency_ms`` per chunk
DB_DROP = "db_drop"  # every connection reset (a commit in flight may or may not land)
DB_STALL = "db_stall"  # connections stay open but no byte moves for the hold
# PostgreSQL fails over: the primary killed with -9, the standby promoted after the hold (the
# time a failover manager takes to decide), the relays' address moved to it, and a new
# standby built from it, so that the next failover has one to promote.
DB_FAILOVER = "db_failover"

#: Faults of the publishing side, played in every run.
PUBLISHING_FAULTS = (
    RELAY_KILL,
    RELAY_TERM,
    BROKER_RESTART,
    POSTGRES_RESTART,
    NET_LATENCY,
    NET_DROP,
    NET_STALL,
)
#: Faults of the consuming stage, played when the run has consumers.
CONSUMING_FAULTS = (CONSUMER_KILL, CONSUMER_TERM)
#: Faults of the writer processes, played when the run has some.
WRITING_FAULTS = (WRITER_KILL,)
#: Faults of the relays' path to PostgreSQL, played when the profile asks for them.
DATABASE_PATH_FAULTS = (DB_LATENCY, DB_DROP, DB_STALL)
#: Faults of a database with a standby, played when the profile has one.
REPLICATION_FAULTS = (DB_FAILOVER,)
#: Faults only a cluster of three nodes or more has.
CLUSTER_FAULTS = (BROKERS_DOWN,)
#: The roles a cluster's ``broker_restart`` picks its node by.
BROKER_ROLES = ("leader", "coordinator")
# Two faults at once: a second one lands while the first holds (a relay killed while the
# broker restarts, the broker restarted while PostgreSQL is down, ...).
OVERLAP = "overlap"
#: Played when the profile asks for them.
OVERLAPPING_FAULTS = (OVERLAP,)
FAULT_KINDS = (
    PUBLISHING_FAULTS
    + CONSUMING_FAULTS
    + WRITING_FAULTS
    + DATABASE_PATH_FAULTS
    + CLUSTER_FAULTS
    + REPLICATION_FAULTS
    + OVERLAPPING_FAULTS
)
#: The first fault of an overlap: one that holds a while, the second landing inside it.
OVERLAP_FIRST = (BROKER_RESTART, POSTGRES_RESTART, NET_LATENCY, DB_LATENCY, NET_STALL)
#: The second: a process killed or stopped, a server restarted, connections reset.
OVERLAP_SECOND = (
    RELAY_KILL,
    RELAY_TERM,
    BROKER_RESTART,
    POSTGRES_RESTART,
    NET_DROP,
    DB_DROP,
    CONSUMER_KILL,
    WRITER_KILL,
)
#: Faults that stop a process: in an overlap it is restarted only once the first fault healed
#: too (a relay's first look at a database that is still down would end it).
PROCESS_FAULTS = (RELAY_KILL, RELAY_TERM, CONSUMER_KILL, CONSUMER_TERM, WRITER_KILL)

#: How long each kind of fault lasts, in seconds: (shortest, longest).
HOLDS: dict[str, tuple[float, float]] = {
    RELAY_KILL: (0.0, 4.0),
    RELAY_TERM: (0.0, 4.0),
    BROKER_RESTART: (1.0, 8.0),
    BROKERS_DOWN: (1.0, 8.0),
    POSTGRES_RESTART: (0.5, 4.0),
    NET_LATENCY: (4.0, 12.0),
    NET_DROP: (1.0, 5.0),
    NET_STALL: (3.0, 15.0),
    CONSUMER_KILL: (0.0, 4.0),
    CONSUMER_TERM: (0.0, 4.0),
    WRITER_KILL: (0.0, 4.0),
    DB_LATENCY: (4.0, 12.0),
    DB_DROP: (1.0, 5.0),
    DB_STALL: (3.0, 15.0),
    DB_FAILOVER: (0.0, 3.0),
}


@dataclass(frozen=True)
class Profile:
    """How long the writers run, how often faults come, how much is written."""

    name: str
    duration: float
    min_gap: float
    max_gap: float
    rate: float  # messages per second, all writers together
    writers: int = 3
    relays: int = 3
    consumers: int = 3  # inbox consumers in one group; 0 leaves the consuming stage out
    #: Writers that are processes of their own (killed with -9 by ``writer_kill``), beside
    #: the ``writers`` threads; at-least-once runs give them immediate send.
    writer_processes: int = 0
    #: Whether latency, resets and stalls hit the relays' connections to PostgreSQL.
    database_path_faults: bool = True
    #: Whether a second fault may land while another holds.
    overlapping_faults: bool = True
    #: Kafka nodes: 1, or a cluster (replication factor and ``min.insync.replicas`` follow).
    brokers: int = 1
    #: PostgreSQL's standby: ``sync``, ``async``, or None (no standby, no failovers).
    replication: str | None = None
    #: Play only these kinds (and only those of them the profile has), not all.
    only: tuple[str, ...] = ()

    @property
    def fault_kinds(self) -> tuple[str, ...]:
        kinds = self._all_kinds()
        return tuple(kind for kind in kinds if kind in self.only) if self.only else kinds

    def _all_kinds(self) -> tuple[str, ...]:
        kinds = PUBLISHING_FAULTS + (CONSUMING_FAULTS if self.consumers else ())
        kinds += WRITING_FAULTS if self.writer_processes else ()
        kinds += DATABASE_PATH_FAULTS if self.database_path_faults else ()
        kinds += CLUSTER_FAULTS if self.brokers >= 3 else ()
        kinds += REPLICATION_FAULTS if self.replication else ()
        return kinds + (OVERLAPPING_FAULTS if self.overlapping_faults else ())


PROFILES = {
    "short": Profile(
        "short", duration=75.0, min_gap=2.0, max_gap=5.0, rate=150.0, writer_processes=2
    ),
    # With a synchronous standby: the first round has a failover, and later ones come at
    # random like every other kind.
    "long": Profile(
        "long",
        duration=1200.0,
        min_gap=3.0,
        max_gap=20.0,
        rate=300.0,
        writer_processes=2,
        replication="sync",
    ),
    # Failovers alone, about three in 25 s of writing: make test's case of each mode.
    "failover": Profile(
        "failover",
        duration=25.0,
        min_gap=4.0,
        max_gap=8.0,
        rate=100.0,
        writers=3,
        relays=2,
        consumers=1,
        writer_processes=1,
        replication="sync",
        only=REPLICATION_FAULTS,
    ),
}


@dataclass(frozen=True)
class Fault:
    """One fault: what, when (seconds after the writers start), on which process, how long."""

    at: float
    kind: str
    hold: float
    relay: int | None = None  # for relay faults: its index
    how: str | None = None  # broker: "term" | "kill"; postgres: "fast" | "immediate"
    latency_ms: int | None = None
    consumer: int | None = None  # for consumer faults: its index
    writer: int | None = None  # for writer faults: its index
    broker: str | None = None  # a cluster's broker_restart: the role of the node it stops
    nodes: tuple[int, ...] = ()  # brokers_down: the node ids stopped
    #: For an overlap: its first fault and the second, which lands while the first holds.
    parts: tuple[Fault, ...] = ()

    @property
    def heals_at(self) -> float:
        return self.at + self.hold

    def describe(self) -> str:
        if self.parts:
            first, second = self.parts
            return (
                f"{self.kind}: {first.describe()}, and {second.at - first.at:.1f}s in "
                f"{second.describe()}"
            )
        parts = [self.kind]
        if self.relay is not None:
            parts.append(f"relay-{self.relay}")
        if self.consumer is not None:
            parts.append(f"consumer-{self.consumer}")
        if self.writer is not None:
            parts.append(f"writer-{self.writer}")
        if self.broker is not None:
            parts.append(f"the {self.broker}")
        if self.nodes:
            parts.append("nodes " + " and ".join(map(str, self.nodes)))
        if self.how:
            parts.append(self.how)
        if self.latency_ms is not None:
            parts.append(f"+{self.latency_ms}ms")
        parts.append(f"for {self.hold:.1f}s")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        body = {
            k: v for k, v in asdict(self).items() if v is not None and k not in ("parts", "nodes")
        }
        if self.nodes:
            body["nodes"] = list(self.nodes)
        if self.parts:
            body["parts"] = [part.to_json() for part in self.parts]
        return body


def plan(seed: int, profile: Profile, duration: float | None = None) -> list[Fault]:
    """The faults of one run: one of each kind first, then random kinds until ``duration``
    (the profile's by default). Same ``seed`` and profile, same list.

    Without consumers, writer processes and database-path faults the kinds are the
    publishing side's only, so such a profile plays the schedule a seed gave before those
    existed."""
    rng = random.Random(seed)
    end = profile.duration if duration is None else duration
    kinds = profile.fault_kinds
    if not kinds:
        return []
    first_round = list(kinds)
    if profile.brokers > 1 and BROKER_RESTART in kinds:  # a broker restart in each role
        first_round += [BROKER_RESTART] * (len(BROKER_ROLES) - 1)
    rng.shuffle(first_round)
    roles = list(BROKER_ROLES)
    faults: list[Fault] = []
    at = rng.uniform(profile.min_gap, profile.max_gap)
    for kind in first_round:
        fault = _draw(rng, kind, at, profile)
        if fault.broker is not None:
            fault = replace(fault, broker=roles.pop(0))
        faults.append(fault)
        at = faults[-1].heals_at + rng.uniform(profile.min_gap, profile.max_gap)
    while True:
        fault = _draw(rng, rng.choice(kinds), at, profile)
        if fault.heals_at > end:
            return faults
        faults.append(fault)
        at = fault.heals_at + rng.uniform(profile.min_gap, profile.max_gap)


def _draw(rng: random.Random, kind: str, at: float, profile: Profile) -> Fault:
    if kind == OVERLAP:
        return _draw_overlap(rng, at, profile)
    low, high = HOLDS[kind]
    hold = round(rng.uniform(low, high), 1)
    at = round(at, 1)
    if kind in (RELAY_KILL, RELAY_TERM):
        return Fault(at, kind, hold, relay=rng.randrange(profile.relays))
    if kind in CONSUMING_FAULTS:
        return Fault(at, kind, hold, consumer=rng.randrange(profile.consumers))
    if kind == WRITER_KILL:
        return Fault(at, kind, hold, writer=rng.randrange(profile.writer_processes))
    if kind == BROKER_RESTART and profile.brokers > 1:
        role = rng.choice(BROKER_ROLES)
        return Fault(at, kind, hold, how=rng.choice(("term", "kill")), broker=role)
    if kind == BROKER_RESTART:
        return Fault(at, kind, hold, how=rng.choice(("term", "kill")))
    if kind == BROKERS_DOWN:
        nodes = tuple(sorted(rng.sample(range(1, profile.brokers + 1), 2)))
        return Fault(at, kind, hold, how=rng.choice(("term", "kill")), nodes=nodes)
    if kind == POSTGRES_RESTART:
        return Fault(at, kind, hold, how=rng.choice(("fast", "immediate")))
    if kind == NET_LATENCY:
        return Fault(at, kind, hold, latency_ms=rng.randrange(50, 800, 10))
    if kind == DB_LATENCY:
        return Fault(at, kind, hold, latency_ms=rng.randrange(5, 300, 5))
    return Fault(at, kind, hold)


def _draw_overlap(rng: random.Random, at: float, profile: Profile) -> Fault:
    """Two faults: the first holds, the second lands inside it. The overlap heals when both
    have; a stopped process comes back only once the first fault healed."""
    kinds = set(profile.fault_kinds)
    first = _draw(rng, rng.choice([k for k in OVERLAP_FIRST if k in kinds]), at, profile)
    # Not a second fault on the first one's proxy: healing it would heal both.
    same_proxy = {NET_LATENCY: NET_DROP, NET_STALL: NET_DROP, DB_LATENCY: DB_DROP}
    seconds = [
        k
        for k in OVERLAP_SECOND
        if k in kinds and k != first.kind and k != same_proxy.get(first.kind)
    ]
    second_at = first.at + rng.uniform(0.1, 0.8) * first.hold
    second = _draw(rng, rng.choice(seconds), second_at, profile)
    if second.kind in PROCESS_FAULTS and second.heals_at < first.heals_at:
        second = replace(second, hold=round(first.heals_at - second.at + 0.1, 1))
    hold = round(max(first.heals_at, second.heals_at) - first.at, 1)
    return Fault(first.at, OVERLAP, hold, parts=(first, second))
