"""A Kafka that a test drives step by step, for the model-based test of the relay loop.

``ModelKafka`` stands for the brokers every relay of a test sends to: it holds the batches in
flight until the test ends each one (acknowledged, failed, timed out, producer lost), keeps
what was delivered (at-least-once) or committed (exactly-once, with the shard's progress
record and the fencing of earlier producers of a shard), and records a violation of the
relay's guarantees the moment one happens:

- a batch started on a shard that has another batch of the same relay in flight;
- a batch started by a relay whose owner session does not hold its shards' locks;
- a row sent again by a relay that was given its acknowledgement, with no session of that
  relay lost since (at-least-once allows a second copy only after a crash or a lost session);
- a key's rows first delivered out of their commit order;
- exactly-once: a row committed twice;
- a row delivered that no transaction committed.

``ModelPublisher`` is one relay's ``BatchPublisher`` on it. Its ``wait`` is the relay loop's
turnstile: the loop calls it at least once a round, and it returns only when the test gives
the relay a step (``ModelRelay.step``), so that the test decides what each relay sees and
when. Once ``crashed``, every call raises :class:`Crash`, which no handler of the relay
catches: the relay's thread ends as a killed process would, with nothing released.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import psycopg
from confluent_kafka import KafkaError
from outbox.relay.producers import InFlight

from outbox.records import OutboxRecord
from outbox.relay.config import RelayConfig
from outbox.relay.daemon import Relay
from outbox.schema import OutboxTableSpec
from outbox.sending import Ack, BatchResult

#: How a batch in flight may end (chosen by the test).
OUTCOMES = ("ack", "retry", "timeout", "dead", "lost")
ERRORS = {
    "retry": KafkaError.NOT_ENOUGH_REPLICAS,  # retriable
    "timeout": KafkaError._MSG_TIMED_OUT,  # retriable: the delivery timeout ran out
    "dead": KafkaError.MSG_SIZE_TOO_LARGE,  # permanent
}


class Crash(BaseException):
    """The relay's process died: raised from every call of a crashed relay's publisher. Not
    an Exception, so that no handler of the relay treats it as an error to recover from."""


@dataclass(eq=False)
class ModelFlight:
    publisher: ModelPublisher
    records: Sequence[OutboxRecord]
    #: Exactly-once: the epoch of the shard's producer that began the transaction.
    epoch: int | None = None
    result: BatchResult = field(default_factory=BatchResult)
    ended: bool = False

    def done(self) -> bool:
        return self.ended

    @property
    def shards(self) -> frozenset[int]:
        return frozenset(record.shard for record in self.records)


class ModelKafka:
    """The brokers of one model run, shared by its relays (thread-safe: one lock)."""

    def __init__(self, conninfo: str, spec: OutboxTableSpec, exactly_once: bool) -> None:
        self.lock = threading.RLock()
        self.exactly_once = exactly_once
        #: The test's own session: whose owner session holds which shard lock.
        self.observer = psycopg.connect(conninfo, autocommit=True)
        self.shard_space = spec.lock_space("shard")
        self.open: list[ModelFlight] = []
        self.deliveries: Counter[uuid.UUID] = Counter()
        #: Each committed row's key and place in the commit order (of all keys).
        self.commit_order: dict[uuid.UUID, tuple[bytes | None, int]] = {}
        self._committed = 0
        self._last_first: dict[bytes | None, int] = {}
        #: Rows a batch failed with an error (they may end dead).
        self.failed: set[uuid.UUID] = set()
        #: Rows that failed with a permanent error: they fail so whenever they are sent (a
        #: message too large stays too large).
        self.too_large: set[uuid.UUID] = set()
        self.epochs: dict[int, int] = {}
        self.progress: dict[int, list[Ack]] = {}
        self.violations: list[str] = []
        self.offsets = 0
        self.batches = 0
        #: At-least-once: a relay that lost its database purges its batches in flight; those
        #: already on the wire may still land (the test sets which).
        self.purged_land = False

    def close(self) -> None:
        self.observer.close()

    # -- the test's side ---------------------------------------------------------------------

    def expect(self, rows: Sequence[tuple[uuid.UUID, bytes | None]]) -> None:
        """``rows`` (id, key), in insert order, are committing now (call under ``lock``)."""
        for row_id, key in rows:
            self._committed += 1
            self.commit_order[row_id] = (key, self._committed)

    def end(self, flight: ModelFlight, outcome: str, which: int = 0) -> None:
        """End ``flight`` with ``outcome`` (see OUTCOMES); a failure hits its record number
        ``which`` (modulo its length), and with it the later records of that key."""
        with self.lock:
            if flight.ended:
                return
            self._close(flight)
            if self.exactly_once:
                self._end_transaction(flight, outcome, which)
            else:
                self._end_batch(flight, outcome, which)

    def terminate_sessions(self, owner: str) -> None:
        """Kill the database sessions of the relay named ``owner`` (its owner session and
        the ones beside it), and wait until their backends are gone."""
        with self.lock:
            pids = [
                row[0]
                for row in self.observer.execute(
                    "SELECT pid FROM pg_stat_activity"
                    " WHERE application_name = %s OR application_name LIKE %s",
                    (owner, owner + "/%"),
                )
            ]
            if not pids:
                return
            self.observer.execute(
                "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,)
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                row = self.observer.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s::int[])", (pids,)
                ).fetchone()
                if row is not None and row[0] == 0:
                    return
                time.sleep(0.01)

    def session_alive(self, owner: str) -> bool:
        """Whether the owner session of the relay named ``owner`` is connected."""
        with self.lock:
            row = self.observer.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (owner,)
            ).fetchone()
        return row is not None and row[0] > 0

    def crash(self, publisher: ModelPublisher, landed: bool) -> None:
        """``publisher``'s relay died: its batches in flight landed (or committed) at once,
        or never do."""
        with self.lock:
            for flight in [f for f in self.open if f.publisher is publisher]:
                self._close(flight)
                if not landed:
                    continue
                if not self.exactly_once:
                    for record in flight.records:
                        if record.id not in self.too_large:
                            self._deliver(record)
                elif flight.epoch == self.epochs.get(flight.records[0].shard) and not any(
                    r.id in self.too_large for r in flight.records
                ):
                    self._commit(flight)

    # -- the publishers' side ----------------------------------------------------------------

    def start(self, publisher: ModelPublisher, records: Sequence[OutboxRecord]) -> list[InFlight]:
        with self.lock:
            self.batches += 1
            shards = {record.shard for record in records}
            # Of this relay: another relay's batch of the shard may still fly when its
            # sessions died under it (at-least-once sends those rows twice; exactly-once
            # fences it when this relay takes the shard over).
            busy = {s for f in self.open if f.publisher is publisher for s in f.shards}
            if shards & busy:
                self.violations.append(
                    f"{publisher.name} started a batch on shards {sorted(shards & busy)}, "
                    "which had a batch of its own in flight"
                )
            again = [r.id for r in records if r.id in publisher.acknowledged]
            if again:
                self.violations.append(
                    f"{publisher.name} sent rows {again} again after it was told Kafka had them,"
                    " its sessions untouched"
                )
            held = self._shards_held_by(publisher.owner)
            if not shards <= held:
                self.violations.append(
                    f"{publisher.name} sent rows of shards {sorted(shards - held)} "
                    "while its owner session did not hold them"
                )
            if not self.exactly_once:
                flights = [ModelFlight(publisher, list(records))]
            else:
                by_shard: dict[int, list[OutboxRecord]] = {}
                for record in records:
                    by_shard.setdefault(record.shard, []).append(record)
                flights = [
                    ModelFlight(publisher, batch, publisher.epochs.get(shard))
                    for shard, batch in by_shard.items()
                ]
            for flight in flights:
                if self.exactly_once and flight.epoch is None:
                    # No producer for the shard (not taken over): nothing is attempted.
                    flight.result.not_attempted = [r.id for r in flight.records]
                    flight.ended = True
                else:
                    self.open.append(flight)
            return list(flights)

    def take_over(self, publisher: ModelPublisher, shards: Sequence[int]) -> list[Ack]:
        if not self.exactly_once:
            return []
        with self.lock:
            recovered: list[Ack] = []
            for shard in shards:
                self.epochs[shard] = publisher.epochs[shard] = self.epochs.get(shard, 0) + 1
                for flight in list(self.open):
                    if shard in flight.shards:  # the earlier producer is fenced
                        self._close(flight)
                        self._lose(flight)
                recovered.extend(self.progress.get(shard, []))
            return recovered

    def purge(self, publisher: ModelPublisher) -> None:
        if self.exactly_once:
            return  # nothing to stop: a take-over fences the producers
        with self.lock:
            for flight in [f for f in self.open if f.publisher is publisher]:
                self._close(flight)
                if self.purged_land:
                    for record in flight.records:
                        if record.id not in self.too_large:
                            self._deliver(record)
                flight.result.not_attempted = [r.id for r in flight.records]

    def end_all(self, publisher: ModelPublisher) -> None:
        for flight in [f for f in self.open if f.publisher is publisher]:
            self.end(flight, "ack")

    # -- internals ----------------------------------------------------------------------------

    def _close(self, flight: ModelFlight) -> None:
        self.open.remove(flight)
        flight.ended = True

    def _lose(self, flight: ModelFlight) -> None:
        flight.result = BatchResult(
            not_attempted=[r.id for r in flight.records], lost_shards=sorted(flight.shards)
        )

    def _end_batch(self, flight: ModelFlight, outcome: str, which: int) -> None:
        """At-least-once: one idempotent producer. After a retriable failure nothing more of
        that key is delivered in the batch."""
        result, records = flight.result, flight.records
        failing = records[which % len(records)]
        stopped_keys: set[bytes | None] = set()
        for record in records:
            if outcome == "lost" and record.shard == failing.shard:
                result.not_attempted.append(record.id)
                if record.shard not in result.lost_shards:
                    result.lost_shards.append(record.shard)
            elif record.id in self.too_large:
                result.errors[record.id] = KafkaError(ERRORS["dead"], "model")
            elif outcome in ERRORS and record is failing:
                result.errors[record.id] = KafkaError(ERRORS[outcome], "model")
                self.failed.add(record.id)
                if outcome == "dead":
                    self.too_large.add(record.id)
                elif record.key is not None:
                    stopped_keys.add(record.key)
            elif record.key is not None and record.key in stopped_keys:
                result.errors[record.id] = KafkaError(KafkaError._MSG_TIMED_OUT, "model")
                self.failed.add(record.id)
            else:
                result.acks.append(self._deliver(record))

    def _end_transaction(self, flight: ModelFlight, outcome: str, which: int) -> None:
        """Exactly-once: one shard's Kafka transaction; any failure aborts all of it."""
        shard = flight.records[0].shard
        too_large = [r for r in flight.records if r.id in self.too_large]
        if flight.epoch != self.epochs.get(shard) or outcome == "lost":
            self._lose(flight)
        elif outcome == "ack" and not too_large:
            self._commit(flight)
        else:
            failing = too_large[0] if too_large else flight.records[which % len(flight.records)]
            error = ERRORS["dead"] if too_large else ERRORS[outcome]
            flight.result.errors[failing.id] = KafkaError(error, "model")
            self.failed.add(failing.id)
            if error == ERRORS["dead"]:
                self.too_large.add(failing.id)
            flight.result.not_attempted = [r.id for r in flight.records if r is not failing]

    def _commit(self, flight: ModelFlight) -> None:
        acks = [self._deliver(record) for record in flight.records]
        flight.result.acks = acks
        self.progress[flight.records[0].shard] = acks

    def _deliver(self, record: OutboxRecord) -> Ack:
        self.deliveries[record.id] += 1
        if self.deliveries[record.id] == 1:
            committed = self.commit_order.get(record.id)
            if committed is None:
                self.violations.append(f"row {record.id} was sent but never committed")
            else:
                key, place = committed
                if place < self._last_first.get(key, 0):
                    self.violations.append(
                        f"row {record.id} of key {key!r} was first sent after a row of its "
                        "key committed later"
                    )
                self._last_first[key] = max(place, self._last_first.get(key, 0))
        elif self.exactly_once:
            self.violations.append(f"exactly-once sent row {record.id} twice")
        self.offsets += 1
        return Ack(record.id, 0, self.offsets, record.generation)

    def _shards_held_by(self, owner: str) -> set[int]:
        rows = self.observer.execute(
            "SELECT l.objid::bigint FROM pg_locks AS l JOIN pg_stat_activity AS a"
            " ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted"
            " AND l.classid = %s::bigint::oid AND l.objsubid = 2 AND a.application_name = %s",
            (self.shard_space, owner),
        ).fetchall()
        return {int(row[0]) for row in rows}


class ModelPublisher:
    """One relay's publisher on a :class:`ModelKafka`; ``wait`` parks the relay's loop until
    the test gives it a step (or lets it run free: ``free``)."""

    def __init__(self, kafka: ModelKafka, name: str) -> None:
        self.kafka = kafka
        self.name = name
        #: The application name of the relay's owner session (set once the relay exists).
        self.owner = ""
        #: Exactly-once: this relay's producer epoch of each shard it took over.
        self.epochs: dict[int, int] = {}
        self.flights: list[ModelFlight] = []
        #: Rows whose acknowledgement this relay's loop was given, its sessions alive, since
        #: they were last killed: it must not send them again (at-least-once too).
        self.acknowledged: set[uuid.UUID] = set()
        self.crashed = False
        #: The loop runs without waiting for steps; with ``auto_ack`` every batch is
        #: acknowledged at the loop's next wait.
        self.free = False
        self.auto_ack = False
        self._tokens = 0
        self._parked = False
        self._turn = threading.Condition()

    def _alive(self) -> None:
        if self.crashed:
            raise Crash(self.name)

    # -- the test's side ---------------------------------------------------------------------

    def step(self, timeout: float) -> bool:
        """Let the loop go on to its next wait; False if it did not get there in time (it
        sleeps, pauses after an error, or waits for a mark)."""
        with self._turn:
            self._tokens += 1
            self._turn.notify_all()
            return self._turn.wait_for(lambda: self._parked and not self._tokens, timeout)

    def wait_parked(self, timeout: float) -> bool:
        with self._turn:
            return self._turn.wait_for(lambda: self._parked and not self._tokens, timeout)

    def release(self, crashed: bool = False, auto_ack: bool = False) -> None:
        """Let the loop run free from now on (or crash at its next call)."""
        with self._turn:
            self.crashed = self.crashed or crashed
            self.auto_ack = self.auto_ack or auto_ack
            self.free = True
            self._turn.notify_all()

    # -- BatchPublisher ------------------------------------------------------------------------

    def check_reachable(self, timeout: float) -> None:
        self._alive()

    def serve_events(self) -> None:
        self._alive()

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        self._alive()
        return self.kafka.take_over(self, shards)

    def let_go(self, shards: Sequence[int]) -> None:
        self._alive()
        for shard in shards:
            self.epochs.pop(shard, None)

    def start(self, records: Sequence[OutboxRecord]) -> list[InFlight]:
        self._alive()
        flights = self.kafka.start(self, records)
        self.flights.extend(flights)  # type: ignore[arg-type]
        return flights

    def wait(self, timeout: float) -> list[InFlight]:
        self._alive()
        if self.free:
            if self.auto_ack:
                self.kafka.end_all(self)
            time.sleep(min(timeout, 0.002))
        else:
            with self._turn:
                self._parked = True
                self._turn.notify_all()
                while not (self._tokens or self.free or self.crashed):
                    self._turn.wait(0.5)
                self._parked = False
                self._tokens = max(0, self._tokens - 1)
        self._alive()
        with self.kafka.lock:
            ended = [flight for flight in self.flights if flight.ended]
            self.flights = [flight for flight in self.flights if not flight.ended]
        acks = [ack.id for flight in ended for ack in flight.result.acks]
        # Given to a relay whose sessions are gone, they cannot be marked: they go again.
        if acks and self.kafka.session_alive(self.owner):
            self.acknowledged.update(acks)
        return list(ended)

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    def stop_sending(self) -> None:
        self._alive()
        self.kafka.purge(self)

    def close(self) -> None:
        self._alive()


class ModelRelay:
    """A real :class:`Relay` on a thread of its own, sending to a :class:`ModelKafka`."""

    def __init__(
        self, kafka: ModelKafka, config: RelayConfig, name: str, read_groups: int = 4
    ) -> None:
        """``read_groups``: the groups the relay reads its shards in, an optimization no
        guarantee may depend on (see ``outbox.relay.reading``)."""
        self.kafka = kafka
        self.name = name
        self.publisher = ModelPublisher(kafka, name)
        self.relay = Relay(config, publisher=self.publisher)
        self.relay.read_groups = read_groups
        self.publisher.owner = self.relay.owner[:63]
        self.thread = threading.Thread(target=self._run, name=f"model-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(Crash):  # the process is gone: nothing of it runs on
            self.relay.run()

    def crash(self, landed: bool) -> None:
        """Kill the relay as a process dies: its sessions end (their locks go with them), its
        batches in flight land or not, and nothing of its own shutdown runs."""
        self.publisher.wait_parked(5.0)  # not in the middle of a statement, if it can be helped
        self.kafka.crash(self.publisher, landed)
        self.kafka.terminate_sessions(self.publisher.owner)
        self.publisher.release(crashed=True)
        self.thread.join(30)
        assert not self.thread.is_alive(), f"{self.name} did not die"
        # Sessions it opened after the first kill (reconnecting before it met the crash).
        self.kafka.terminate_sessions(self.publisher.owner)
        for session in self.relay._sessions():  # dead already: only the client's side is left
            session.close()
        self.relay.store.close()
        self.relay.engine.dispose()

    def stop(self) -> None:
        """Stop the relay as SIGTERM does: its batches in flight are acknowledged."""
        self.relay.stop()
        self.publisher.release(auto_ack=True)
        self.thread.join(60)
        assert not self.thread.is_alive(), f"{self.name} did not stop"
