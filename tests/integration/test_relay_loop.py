"""The relay's loop against a publisher standing in for Kafka, on a real PostgreSQL: what the
loop does with what Kafka says (acks, retriable and permanent errors, lost shards), how it
keeps two batches in flight on disjoint shards, and how it shuts down. Fast: no broker."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import sqlalchemy as sa
from confluent_kafka import KafkaError, KafkaException

from outbox import Message, Outbox
from outbox.engines import sender_engine
from outbox.records import OutboxRecord
from outbox.relay.config import RelayConfig
from outbox.relay.daemon import Relay
from outbox.relay.policy import RetryPolicy
from outbox.relay.producers import InFlight
from outbox.relay.store import RelayStore
from outbox.schema import SHARD_COUNT, OutboxTableSpec
from outbox.sending import Ack, BatchResult
from tests.relay_helpers import looping

pytestmark = pytest.mark.integration


@dataclass(eq=False)
class StubFlight:
    records: Sequence[OutboxRecord]
    result: BatchResult = field(default_factory=BatchResult)
    ends_at: float = 0.0
    ended: bool = False

    def done(self) -> bool:
        return self.ended


class StubPublisher:
    """Acknowledges each batch ``latency`` seconds after it started, unless ``decide`` says
    otherwise for a record: "retry" (a retriable error), "dead" (a permanent one) or "lost"
    (the shard's producer cannot go on)."""

    def __init__(self, latency: float = 0.02) -> None:
        self.latency = latency
        self.decide: Callable[[OutboxRecord], str] = lambda record: "ack"
        self.flights: list[StubFlight] = []
        self.acked: list[OutboxRecord] = []
        self.log: list[tuple[str, frozenset[int]]] = []  # ("start" | "end", shards)
        self.in_flight_shards: set[int] = set()
        self.overlaps = 0  # starts while another batch was in flight
        self.offsets = 0
        self.lock = threading.Lock()

    # -- BatchPublisher ------------------------------------------------------------------

    def check_reachable(self, timeout: float) -> None:
        return None

    def serve_events(self) -> None:
        return None

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        return []

    def let_go(self, shards: Sequence[int]) -> None:
        return None

    def start(self, records: Sequence[OutboxRecord]) -> list[InFlight]:
        shards = frozenset(r.shard for r in records)
        assert not shards & self.in_flight_shards, "a shard had two batches in flight"
        if self.flights:
            self.overlaps += 1
        self.in_flight_shards |= shards
        flight = StubFlight(records, ends_at=time.monotonic() + self.latency)
        self.flights.append(flight)
        self.log.append(("start", shards))
        return [flight]

    def wait(self, timeout: float) -> list[InFlight]:
        if self.flights:
            time.sleep(
                max(0.0, min(timeout, min(f.ends_at for f in self.flights) - time.monotonic()))
            )
        else:
            time.sleep(timeout)
        ended = [f for f in self.flights if f.ends_at <= time.monotonic()]
        for flight in ended:
            self._end(flight)
            self.flights.remove(flight)
        return list(ended)

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    def stop_sending(self) -> None:
        return None

    def close(self) -> None:
        return None

    def _end(self, flight: StubFlight) -> None:
        failed_keys: set[tuple[str, bytes | None]] = set()
        for record in flight.records:
            verdict = self.decide(record)
            if (record.topic, record.key) in failed_keys and record.key is not None:
                verdict = "retry"  # the idempotent producer: nothing of a key after a failure
            if verdict == "ack":
                self.offsets += 1
                flight.result.acks.append(Ack(record.id, 0, self.offsets, record.generation))
                self.acked.append(record)
            elif verdict == "retry":
                failed_keys.add((record.topic, record.key))
                flight.result.errors[record.id] = KafkaError(KafkaError._TIMED_OUT, "stub")
            elif verdict == "dead":
                flight.result.errors[record.id] = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
            elif verdict == "lost":
                flight.result.not_attempted.append(record.id)
                if record.shard not in flight.result.lost_shards:
                    flight.result.lost_shards.append(record.shard)
        self.in_flight_shards -= {r.shard for r in flight.records}
        self.log.append(("end", frozenset(r.shard for r in flight.records)))


def config(outbox_url: str, **overrides: object) -> RelayConfig:
    options: dict = {
        "database_url": outbox_url,
        "kafka": {"bootstrap.servers": "127.0.0.1:9"},  # never used: the stub publishes
        "batch_size": 100,
        "poll_interval": 0.1,
        "rebalance_interval": 0.2,
        "retry": RetryPolicy(max_attempts=3, base_seconds=0.05, cap_seconds=0.1),
    }
    options.update(overrides)
    return RelayConfig(**options)


def publish(engine: sa.Engine, count: int, keys: int) -> list[uuid.UUID]:
    with Outbox(engine).transaction() as tx:
        results = tx.publish_many(
            [Message("loop", {"n": n}, key=f"k{n % keys}") for n in range(count)]
        )
    return [r.message_id for r in results]


def statuses(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM outbox GROUP BY status"))
        return {status: count for status, count in rows}


def wait_for(condition: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def by_key_in_seq_order(records: Sequence[OutboxRecord]) -> bool:
    last: dict[bytes | None, int] = {}
    for record in records:
        if record.seq < last.get(record.key, -1):
            return False
        last[record.key] = record.seq
    return True


def test_two_batches_are_in_flight_at_once_on_disjoint_shards(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    publish(engine, 3000, keys=200)
    stub = StubPublisher(latency=0.03)
    with looping(Relay(config(outbox_url), publisher=stub)):
        wait_for(lambda: statuses(engine) == {"sent": 3000})
    assert stub.overlaps > 0  # the next batch started while the last was in flight
    assert len(stub.acked) == 3000 and by_key_in_seq_order(stub.acked)


class SlowMarks(RelayStore):
    """Marks that take ``seconds`` on the owner session; when each ran, and on which shards."""

    def __init__(self, url: str, seconds: float) -> None:
        super().__init__(sender_engine(url), OutboxTableSpec(), "slow-marks")
        self.seconds = seconds
        self.shard_of: dict[uuid.UUID, int] = {}
        self.marks: list[tuple[float, float, frozenset[int]]] = []
        #: Set while a mark sleeps: its session is busy.
        self.sleeping = threading.Event()

    def read_batch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        rows = super().read_batch(*args, **kwargs)
        self.shard_of.update((row.id, row.shard) for row in rows)
        return rows

    def mark_acked(self, acks, connection, owner_key):  # type: ignore[no-untyped-def]
        began = time.monotonic()
        self.sleeping.set()
        try:
            connection.execute("SELECT pg_sleep(%s)", (self.seconds,))
        finally:
            self.sleeping.clear()
        super().mark_acked(acks, connection, owner_key)
        shards = frozenset(self.shard_of[a.id] for a in acks)
        self.marks.append((began, time.monotonic(), shards))


class TimedStub(StubPublisher):
    def __init__(self, latency: float) -> None:
        super().__init__(latency)
        self.starts: list[tuple[float, frozenset[int]]] = []
        self.waits: list[float] = []

    def start(self, records: Sequence[OutboxRecord]) -> list[InFlight]:
        self.starts.append((time.monotonic(), frozenset(r.shard for r in records)))
        return super().start(records)

    def wait(self, timeout: float) -> list[InFlight]:
        self.waits.append(time.monotonic())
        return super().wait(timeout)


def test_a_batch_is_marked_in_the_background_and_its_shards_wait_for_the_mark(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    """While a batch's mark runs, the loop goes on serving Kafka (the other batch in flight
    ends meanwhile); the batch's shards are read again only after it is recorded: nothing goes
    twice, keys stay in order."""
    publish(engine, 3000, keys=200)
    store = SlowMarks(outbox_url, seconds=0.1)
    stub = TimedStub(latency=0.01)
    try:
        with looping(Relay(config(outbox_url), store=store, publisher=stub)):
            wait_for(lambda: statuses(engine) == {"sent": 3000})
    finally:
        store.engine.dispose()
    assert len(stub.acked) == 3000 and by_key_in_seq_order(stub.acked)
    served_during_a_mark = [
        at for at in stub.waits for began, ended, _ in store.marks if began < at < ended
    ]
    assert served_during_a_mark, "Kafka was not served while a mark ran: marks stop the loop"
    for at, shards in stub.starts:
        for began, ended, marked in store.marks:
            assert not (began < at < ended and shards & marked), (
                "a shard's rows were read again while its batch was being marked"
            )


def test_failures_are_recorded_after_the_background_marks_and_keys_keep_their_order(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    """Batches with failures are recorded by the loop in a transaction of its own, after the
    marks running in the background: every message goes once it is acknowledged, a retried
    key's later messages wait for it, and each failure is counted as an attempt."""
    ids = publish(engine, 2000, keys=100)
    failing = set(ids[::97])
    tries: dict[uuid.UUID, int] = {}

    def decide(record: OutboxRecord) -> str:
        if record.id in failing and tries.get(record.id, 0) < 1:
            tries[record.id] = tries.get(record.id, 0) + 1
            return "retry"
        return "ack"

    store = SlowMarks(outbox_url, seconds=0.05)
    stub = StubPublisher(latency=0.01)
    stub.decide = decide
    try:
        with looping(Relay(config(outbox_url), store=store, publisher=stub)):
            wait_for(lambda: statuses(engine) == {"sent": 2000}, 60)
    finally:
        store.engine.dispose()
    assert tries == {message_id: 1 for message_id in failing}
    assert len(stub.acked) == 2000 and by_key_in_seq_order(stub.acked)
    with engine.connect() as conn:
        attempts = conn.execute(
            sa.text("SELECT id, attempts FROM outbox WHERE id = ANY(:ids)"), {"ids": list(failing)}
        ).all()
    assert {row.attempts for row in attempts} == {2}


class LettingGo(StubPublisher):
    def __init__(self, latency: float) -> None:
        super().__init__(latency)
        self.let_go_shards: set[int] = set()

    def let_go(self, shards: Sequence[int]) -> None:
        self.let_go_shards.update(shards)


def test_a_session_lost_under_a_background_mark_lets_go_of_its_shards_and_sends_everything(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    """The owner session dies while a batch is being marked in the background: the relay lets
    go of the shards that session held before it connects again, then takes them back and
    sends every row (at least once)."""
    from outbox.schema import SHARD_COUNT

    ids = publish(engine, 3000, keys=200)
    store = SlowMarks(outbox_url, seconds=0.3)
    stub = LettingGo(latency=0.01)
    relay = Relay(config(outbox_url), store=store, publisher=stub)
    try:
        with looping(relay):
            assert store.sleeping.wait(20)
            owned = set(relay._ownership.owned) if relay._ownership else set()
            with engine.connect() as conn:
                killed = conn.execute(
                    sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = :name"
                    ),
                    {"name": relay.owner[:63]},
                ).scalar_one()
            assert killed == 1
            wait_for(lambda: statuses(engine) == {"sent": 3000}, 60)
    finally:
        store.engine.dispose()
    assert len(owned) == SHARD_COUNT and stub.let_go_shards >= owned
    assert {record.id for record in stub.acked} == set(ids)  # each went, some twice


class OwnedWhileMarked(SlowMarks):
    """Slow background marks that look, once they slept, at the shards their relay's owner
    session still holds (in ``pg_locks``): a mark must never run over a shard let go."""

    def __init__(self, url: str, seconds: float) -> None:
        super().__init__(url, seconds)
        self.checked = 0
        self.let_go_under_a_mark: list[frozenset[int]] = []

    def mark_acked(self, acks, connection, owner_key):  # type: ignore[no-untyped-def]
        if owner_key is not None:
            connection.execute("SELECT pg_sleep(%s)", (self.seconds,))
            held = {
                int(row[0])
                for row in connection.execute(
                    "SELECT s.objid::bigint FROM pg_locks AS s JOIN pg_locks AS o"
                    " ON o.pid = s.pid AND o.locktype = 'advisory' AND o.classid = %s::oid"
                    " AND o.objid = %s::bigint::oid AND o.objsubid = 2"
                    " WHERE s.locktype = 'advisory' AND s.classid = %s::oid AND s.objsubid = 2",
                    (
                        self.spec.lock_space("session"),
                        owner_key,
                        self.spec.lock_space("shard"),
                    ),
                )
            }
            marked = frozenset(self.shard_of[a.id] for a in acks)
            self.checked += 1
            if not marked <= held:
                self.let_go_under_a_mark.append(marked - held)
        return RelayStore.mark_acked(self, acks, connection, owner_key)


def test_a_shard_is_never_let_go_while_a_mark_of_it_runs(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    """Reads and marks beside the owner session check only that it lives: the loop itself
    keeps them to the shards it holds. A second member appears while a batch over every shard
    is being marked: the relay lets half its shards go only once the mark is recorded."""
    import psycopg

    publish(engine, 400, keys=100)
    store = OwnedWhileMarked(outbox_url, seconds=1.0)
    relay = Relay(config(outbox_url), store=store, publisher=StubPublisher(latency=0.01))
    conninfo = sa.make_url(outbox_url).set(drivername="postgresql").render_as_string(False)
    member = psycopg.connect(conninfo, autocommit=True)
    try:
        relay._connect()
        relay._maybe_rebalance()
        assert relay._ownership is not None and len(relay._ownership.owned) == SHARD_COUNT
        deadline = time.monotonic() + 10
        while not len(relay._recorder):  # until a batch is acknowledged and being marked
            assert time.monotonic() < deadline
            relay._step()
        member.execute(
            "SELECT pg_advisory_lock(%s, %s)", (OutboxTableSpec().lock_space("member"), 999_999)
        )
        relay._next_rebalance = 0.0
        relay._maybe_rebalance()
        relay._collect_recordings(block=True)
        assert store.checked == 1 and store.let_go_under_a_mark == []
        assert len(relay._ownership.owned) == SHARD_COUNT // 2
    finally:
        relay.stop()
        relay._shutdown()
        member.close()
        store.engine.dispose()


def test_a_transaction_written_to_an_idle_relay_goes_in_one_batch_over_all_its_shards(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    """At a low rate the relay reads every owned shard at once: a transaction whose messages
    fall in both halves of the shards is one read and one batch, not two."""
    from outbox.schema import SHARD_COUNT

    stub = StubPublisher(latency=0.01)
    with looping(Relay(config(outbox_url), publisher=stub)) as relay:
        wait_for(
            lambda: relay._ownership is not None and len(relay._ownership.owned) == SHARD_COUNT
        )
        ids = publish(engine, 40, keys=40)
        wait_for(lambda: statuses(engine) == {"sent": 40})
    starts = [shards for event, shards in stub.log if event == "start"]
    shards = {record.shard for record in stub.acked}
    assert len(shards) > SHARD_COUNT // 2  # the messages span both halves
    assert starts == [frozenset(shards)]
    assert {record.id for record in stub.acked} == set(ids)


def test_a_relay_woken_for_one_message_reads_it_in_whichever_half_of_its_shards(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    """A sleeping relay woken by a commit finds the row whatever shard it is in: it does not
    read one half of its shards, find nothing, and sleep again until its poll interval."""
    from outbox.schema import SHARD_COUNT, shard_of

    keys = [f"k{n}" for n in range(200)]
    low = [k for k in keys if shard_of(k.encode(), uuid.uuid4()) < SHARD_COUNT // 2][:5]
    high = [k for k in keys if shard_of(k.encode(), uuid.uuid4()) >= SHARD_COUNT // 2][:5]
    stub = StubPublisher(latency=0.01)
    relay = Relay(config(outbox_url, poll_interval=8.0, rebalance_interval=8.0), publisher=stub)
    with looping(relay):
        wait_for(
            lambda: relay._ownership is not None and len(relay._ownership.owned) == SHARD_COUNT
        )
        for number, key in enumerate(k for pair in zip(low, high, strict=True) for k in pair):
            with Outbox(engine).transaction() as tx:
                tx.publish("loop", {"n": number}, key=key)
            # Far below the poll interval: only the commit's wake-up can have sent it.
            wait_for(lambda n=number: len(stub.acked) == n + 1, 5)
    assert statuses(engine) == {"sent": 10}


def test_a_transaction_committed_beside_a_batch_in_flight_goes_in_one_batch(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    """Caught up (the last read took fewer rows than one shard may give), a relay with a batch
    in flight reads every idle shard at once: a transaction's messages, spread over shards of
    several read groups, go in one batch after one read, not one read per group."""
    from outbox.schema import SHARD_COUNT, shard_of

    by_shard: dict[int, str] = {}
    for n in range(1000):
        by_shard.setdefault(shard_of(f"k{n}".encode(), uuid.uuid4()), f"k{n}")
    first, spread = by_shard[0], [by_shard[s] for s in range(4, SHARD_COUNT, 2)]
    stub = StubPublisher(latency=1.0)
    relay = Relay(config(outbox_url, poll_interval=8.0, rebalance_interval=8.0), publisher=stub)
    with looping(relay):
        wait_for(
            lambda: relay._ownership is not None and len(relay._ownership.owned) == SHARD_COUNT
        )
        with Outbox(engine).transaction() as tx:
            tx.publish("loop", {"n": 0}, key=first)
        wait_for(lambda: len(stub.log) == 1, 5)  # its batch is in flight for a second
        with Outbox(engine).transaction() as tx:
            tx.publish_many([Message("loop", {"n": n}, key=key) for n, key in enumerate(spread)])
        wait_for(lambda: len(stub.acked) == 1 + len(spread), 5)
    starts = [shards for kind, shards in stub.log if kind == "start"]
    assert starts == [frozenset({0}), frozenset(range(4, SHARD_COUNT, 2))]
    assert stub.overlaps == 1  # the second batch started while the first was in flight


@pytest.mark.parametrize("batch_size", [1000, 50])
def test_a_backlog_of_two_keys_in_two_groups_is_read_beside_the_batch_in_flight(
    engine, outbox_url, batch_size
) -> None:  # type: ignore[no-untyped-def]
    """A backlog that sits in two shards of different read groups still keeps two batches in
    flight: once a read took as many rows as one shard may give, the relay reads a group at a
    time at a group-read's window; an empty group is followed by the next, not by all the
    others. A batch size below a shard's smallest window (100) counts as a backlog too."""
    from outbox.schema import SHARD_COUNT, shard_of

    keys = [f"k{n}" for n in range(200)]
    low = next(k for k in keys if shard_of(k.encode(), uuid.uuid4()) < SHARD_COUNT // 2)
    high = next(k for k in keys if shard_of(k.encode(), uuid.uuid4()) >= SHARD_COUNT // 2)
    with Outbox(engine).transaction() as tx:
        tx.publish_many([Message("loop", {"n": n}, key=(low, high)[n % 2]) for n in range(3000)])
    stub = StubPublisher(latency=0.03)
    with looping(Relay(config(outbox_url, batch_size=batch_size), publisher=stub)):
        wait_for(lambda: statuses(engine) == {"sent": 3000})
    assert stub.overlaps > 0  # one key's batch started while the other's was in flight
    assert by_key_in_seq_order(stub.acked)


@contextmanager
def another_relay_watching(outbox_url: str) -> Iterator[None]:
    """A session that holds the sleeper and wake locks as a sleeping watcher relay does:
    the relay under test is then not the watcher, and only writers' NOTIFYs wake it."""
    import psycopg

    from outbox.schema import OutboxTableSpec

    spec = OutboxTableSpec()
    url = sa.make_url(outbox_url).set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as conn:
        conn.execute(
            "SELECT pg_advisory_lock(%s, %s), pg_advisory_lock(%s, %s)",
            (*spec.sleeper_lock, *spec.wake_lock),
        )
        yield


@pytest.mark.parametrize("keys", [1, 200])
def test_a_relay_that_is_not_the_watcher_drains_a_backlog_without_sleeping_between_batches(
    engine, outbox_url, keys
) -> None:  # type: ignore[no-untyped-def]
    """Rows left behind a batch (the batch size, one key's window) are read as soon as the
    batch is recorded: no commit is left to wake a relay that another relay watches for."""
    from outbox.schema import SHARD_COUNT

    stub = StubPublisher(latency=0.01)
    relay = Relay(config(outbox_url, poll_interval=8.0, rebalance_interval=8.0), publisher=stub)
    with another_relay_watching(outbox_url), looping(relay):
        wait_for(
            lambda: relay._ownership is not None and len(relay._ownership.owned) == SHARD_COUNT
        )
        publish(engine, 1000, keys=keys)  # ten batches of 100 or more
        # Far below the poll interval: a relay that slept after a batch would take 8 s.
        wait_for(lambda: statuses(engine) == {"sent": 1000}, 5)
    assert by_key_in_seq_order(stub.acked)


def test_a_retried_message_holds_back_only_its_key_and_goes_first_when_due(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    ids = publish(engine, 400, keys=20)
    failing = ids[0]
    attempts = {"n": 0}

    def decide(record: OutboxRecord) -> str:
        if record.id == failing and attempts["n"] < 2:
            attempts["n"] += 1
            return "retry"
        return "ack"

    stub = StubPublisher()
    stub.decide = decide
    with looping(Relay(config(outbox_url), publisher=stub)):
        wait_for(lambda: statuses(engine) == {"sent": 400})
    assert attempts["n"] == 2
    assert by_key_in_seq_order(stub.acked)
    with engine.connect() as conn:
        tried = conn.execute(sa.text("SELECT attempts FROM outbox WHERE id = :id"), {"id": failing})
        assert tried.scalar_one() == 3


def test_a_permanent_error_makes_one_message_dead_and_the_rest_go(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    ids = publish(engine, 50, keys=5)
    stub = StubPublisher()
    stub.decide = lambda record: "dead" if record.id == ids[7] else "ack"
    with looping(Relay(config(outbox_url), publisher=stub)):
        wait_for(lambda: statuses(engine) == {"sent": 49, "dead": 1})
    with engine.connect() as conn:
        kind = conn.execute(sa.text("SELECT error_kind FROM outbox WHERE status = 'dead'"))
        assert kind.scalar_one() == "message_too_large"


def test_a_lost_shard_is_let_go_and_its_rows_stay_pending_for_the_next_owner(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    publish(engine, 200, keys=40)
    lost: dict[str, float] = {}
    stub = StubPublisher()

    def decide(record: OutboxRecord) -> str:
        # The first shard seen loses its producer for a moment; everything else goes.
        lost.setdefault("shard", record.shard)
        lost.setdefault("until", time.monotonic() + 0.05)
        if record.shard == lost["shard"] and time.monotonic() < lost["until"]:
            return "lost"
        return "ack"

    stub.decide = decide
    with looping(Relay(config(outbox_url), publisher=stub)):
        wait_for(lambda: statuses(engine) == {"sent": 200}, 30)
    assert len(stub.acked) == 200  # each once, the lost shard's after it came back
    assert by_key_in_seq_order(stub.acked)


def test_shutdown_waits_for_the_batch_in_flight_and_records_it(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    publish(engine, 2000, keys=10)
    stub = StubPublisher(latency=1.0)
    relay = Relay(config(outbox_url, batch_size=1000), publisher=stub)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    wait_for(lambda: stub.in_flight > 0)
    relay.stop()
    thread.join(30)
    assert not thread.is_alive()
    # Every batch started before the stop is recorded; rows beyond the batches started (a
    # batch holds 1,000) stay pending, untouched.
    assert 0 < len(stub.acked) < 2000
    expected = {"sent": len(stub.acked), "pending": 2000 - len(stub.acked)}
    assert statuses(engine) == {k: v for k, v in expected.items() if v}
    with engine.connect() as conn:
        sent = conn.execute(sa.text("SELECT id FROM outbox WHERE status = 'sent'")).scalars()
        assert set(sent) == {record.id for record in stub.acked}
    with engine.connect() as conn:
        held = conn.execute(
            sa.text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted")
        )
        assert held.scalar_one() == 0  # shards released


def test_a_batch_refused_by_the_producer_itself_is_recorded_and_its_shard_goes_on(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    """A record librdkafka refuses in produce() (larger than its message.max.bytes once the
    headers are counted) fails its batch before anything is in flight: the row is dead at once
    and the shard's later rows are read and sent. No broker is needed to show it."""
    from outbox.relay.producers import AtLeastOncePublisher

    class Unprobed(AtLeastOncePublisher):
        def check_reachable(self, timeout: float) -> None:
            return None  # nothing listens at the bootstrap address: the batch fails locally

    relay_config = config(outbox_url, delivery_timeout_ms=2000)
    publisher = Unprobed(relay_config.kafka, relay_config.delivery_timeout_ms)
    with Outbox(engine).transaction() as tx:
        big = tx.publish("loop", b"x" * 999_990, key="big").message_id
    with looping(Relay(relay_config, publisher=publisher)) as relay:
        wait_for(lambda: statuses(engine) == {"dead": 1}, 10)
        with Outbox(engine).transaction() as tx:  # the shard is read again
            tx.publish("loop", b"small", key="big")
        wait_for(lambda: statuses(engine) == {"dead": 1, "pending": 1}, 5)
        wait_for(lambda: not relay._busy_shards, 10)
    with engine.connect() as conn:
        kind = conn.execute(sa.text("SELECT error_kind FROM outbox WHERE id = :id"), {"id": big})
        assert kind.scalar_one() == "message_too_large"


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [({}, "off"), ({"durable_marks": True}, "on"), ({"mode": "exactly-once"}, "on")],
)
def test_marks_wait_for_the_disk_flush_only_where_a_forgotten_mark_would_duplicate(  # type: ignore[no-untyped-def]
    engine, outbox_url, overrides, setting
) -> None:
    with engine.connect() as conn:  # a database default must not decide it
        database = conn.execute(sa.text("SELECT current_database()")).scalar_one()
        conn.execute(sa.text(f'ALTER DATABASE "{database}" SET synchronous_commit = off'))
        conn.commit()
    publish(engine, 10, keys=5)
    relay = Relay(config(outbox_url, **overrides), publisher=StubPublisher(latency=0.01))
    with looping(relay):
        wait_for(lambda: statuses(engine) == {"sent": 10})
        assert relay._conn is not None
        row = relay._conn.execute("SHOW synchronous_commit").fetchone()
        with relay.store.marking_engine.connect() as conn:  # exactly-once recovery marks here
            marking = conn.execute(sa.text("SHOW synchronous_commit")).scalar_one()
    assert row == (setting,)
    assert marking == "on"


def eos_config(outbox_url: str) -> RelayConfig:
    """Take-overs ask Kafka for something only exactly-once: only there do they fail."""
    return config(outbox_url, mode="exactly-once")


class FailingTakeOvers(StubPublisher):
    """A relay whose shard take-overs always time out (its own path to Kafka is broken)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        self.failures += 1
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "stub: no answer"))


def owns_all(relay: Relay) -> bool:
    from outbox.schema import SHARD_COUNT

    return relay._ownership is not None and len(relay._ownership.owned) == SHARD_COUNT


def serves_all(relay: Relay) -> bool:
    """Owns every shard, has taken each over, and says so to the other members: a relay that
    joins now and fails may step aside for it at once."""
    return owns_all(relay) and not relay._take_overs and relay._ownership.serving  # type: ignore[union-attr]


def test_a_relay_whose_take_overs_keep_failing_steps_aside_and_the_healthy_one_sends_all(  # type: ignore[no-untyped-def]
    engine, outbox_url, monkeypatch
) -> None:
    """Without stepping aside, the failing relay keeps its share of the shards (it locks them
    again at each rebalance) and their messages wait for it for good."""
    from outbox.relay import serving

    monkeypatch.setattr(serving, "STEP_ASIDE_SECONDS", 1.5)
    healthy_stub, failing_stub = StubPublisher(), FailingTakeOvers()
    healthy = Relay(eos_config(outbox_url), publisher=healthy_stub)
    failing = Relay(eos_config(outbox_url), publisher=failing_stub)
    with looping(healthy):
        # Joining before the healthy relay serves, the failing one rightly keeps trying while
        # nobody else can send (test_the_last_relay_never_steps_aside): more failures.
        wait_for(lambda: serves_all(healthy))
        with looping(failing):
            wait_for(lambda: failing.health.stepped_aside)
            assert failing_stub.failures == serving.FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE
            publish(engine, 400, keys=100)  # every shard gets some
            wait_for(lambda: statuses(engine) == {"sent": 400})
            assert len(healthy_stub.acked) == 400 and by_key_in_seq_order(healthy_stub.acked)
            assert owns_all(healthy)
            assert (
                not failing.health.ready and "stepped aside" in failing.health.not_ready_because()
            )
            # Back after its pause, one failed take-over sends it out again, twice as long.
            wait_for(lambda: failing.step_asides == 2, 20)
            assert failing_stub.failures == serving.FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE + 1
            # Its return made the healthy relay give it a share for a moment; it takes it back.
            wait_for(lambda: owns_all(healthy), 5)
            publish(engine, 100, keys=100)
            wait_for(lambda: statuses(engine) == {"sent": 500})
            assert len(healthy_stub.acked) == 500 and by_key_in_seq_order(healthy_stub.acked)


def test_relays_whose_take_overs_all_fail_never_step_aside(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    """Kafka is unwell for both: neither has shown it can publish, so neither steps aside on
    the other's account (without the serving locks each sees the other as a member, and
    both step aside)."""
    stubs = [FailingTakeOvers(), FailingTakeOvers()]
    relays = [Relay(eos_config(outbox_url), publisher=stub) for stub in stubs]
    with looping(relays[0]):
        wait_for(lambda: stubs[0].failures >= 1)
        with looping(relays[1]):  # joins while the first one has failed once
            wait_for(lambda: all(stub.failures >= 4 for stub in stubs), 30)
            assert not any(relay.step_asides for relay in relays)


class BreakablePublisher(StubPublisher):
    """Take-overs fail the first ``fail_first`` times and while ``fail`` is set; while
    ``unreachable`` is set the reachability probe fails too."""

    def __init__(self, fail_first: int = 0) -> None:
        super().__init__()
        self.fail_first = fail_first
        self.fail = False
        self.unreachable = False
        self.failures = 0
        self.on_failure: Callable[[], None] = lambda: None

    def check_reachable(self, timeout: float) -> None:
        if self.unreachable:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "stub: unreachable"))

    def take_over(self, shards: Sequence[int]) -> list[Ack]:
        if self.fail or self.unreachable or self.failures < self.fail_first:
            self.failures += 1
            self.on_failure()
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "stub: no answer"))
        return []


@contextmanager
def a_steps_aside_for_b(
    outbox_url: str, b_stub: StubPublisher, a_stub: StubPublisher
) -> Iterator[tuple[Relay, Relay]]:
    """B owns every shard; then A joins, fails its take-overs and steps aside for B."""
    b = Relay(eos_config(outbox_url), publisher=b_stub)
    a = Relay(eos_config(outbox_url), publisher=a_stub)
    with looping(b):
        wait_for(lambda: serves_all(b))
        with looping(a):
            wait_for(lambda: a.step_asides == 1)
            yield a, b


@pytest.mark.parametrize("how", ["its take-overs fail", "Kafka is out of its reach"])
def test_a_relay_that_stepped_aside_comes_back_when_the_one_it_left_its_share_to_fails(  # type: ignore[no-untyped-def]
    engine, outbox_url, monkeypatch, how
) -> None:
    """A steps aside for B; then B stops serving. A, healthy again, must not wait out its
    pause (30 s here) while its share has nobody who can send it."""
    from outbox.relay import serving

    monkeypatch.setattr(serving, "STEP_ASIDE_SECONDS", 30.0)
    b_stub, a_stub = BreakablePublisher(), BreakablePublisher(fail_first=2)

    def break_b() -> None:  # as A fails for the second time, before B takes A's share back
        if a_stub.failures < 2:
            return
        if how == "its take-overs fail":
            b_stub.fail = True
        else:
            b_stub.unreachable = True

    a_stub.on_failure = break_b
    with a_steps_aside_for_b(outbox_url, b_stub, a_stub) as (a, _):
        publish(engine, 400, keys=100)
        # B cannot take A's share any more: A comes back for it.
        wait_for(lambda: statuses(engine) == {"sent": 400}, 10)
        assert not a.health.stepped_aside
        assert a._ownership is not None and a._ownership.joined and a._ownership.owned


def test_no_relay_steps_aside_for_an_idle_one_that_kafka_no_longer_answers(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    """B served once, then Kafka went out of everyone's reach while B idled: its probe says
    so, and A, whose take-overs fail, stays (without the probe, B would serve for good)."""
    b_stub, a_stub = BreakablePublisher(), BreakablePublisher()
    b = Relay(eos_config(outbox_url), publisher=b_stub)
    a = Relay(eos_config(outbox_url), publisher=a_stub)
    with looping(b):
        wait_for(lambda: owns_all(b) and b._ownership.serving)  # type: ignore[union-attr]
        b_stub.unreachable = True
        wait_for(lambda: not b._ownership.serving, 15)  # type: ignore[union-attr]
        a_stub.fail = True  # its probe passes, its take-overs fail
        with looping(a):
            wait_for(lambda: a_stub.failures >= 4, 30)
            assert a.step_asides == 0


def test_an_idle_relay_serves_again_once_kafka_answers_it(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    """B had a batch turned back (a blip), then no traffic: its probe shows it can serve
    again, so A, whose take-overs keep failing, hands its share to B instead of holding it
    unsent."""
    from outbox.schema import shard_of

    b_stub, a_stub = BreakablePublisher(), BreakablePublisher()
    b = Relay(eos_config(outbox_url), publisher=b_stub)
    a = Relay(eos_config(outbox_url), publisher=a_stub)
    with looping(b):
        wait_for(lambda: owns_all(b))
        b_stub.decide = lambda record: "retry"
        publish(engine, 1, keys=1)
        wait_for(lambda: "pending" not in statuses(engine))  # retried, then dead
        b_stub.decide = lambda record: "ack"
        assert b._ownership is not None and not b._ownership.serving
        a_stub.fail = True
        with looping(a):
            wait_for(lambda: a_stub.failures >= 2, 30)
            b_shards = set(b._ownership.owned)
            key = next(
                f"x{n}"
                for n in range(1000)
                if shard_of(f"x{n}".encode(), uuid.uuid4()) not in b_shards
            )
            with Outbox(engine).transaction() as tx:
                tx.publish("loop", {"n": 1}, key=key)
            wait_for(lambda: statuses(engine).get("pending", 0) == 0, 15)
            assert a.step_asides >= 1


def test_a_relay_that_stepped_aside_does_not_watch_for_the_others(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    """Owning nothing, it is always idle: if it held the wake lock while the others work,
    every writer would notify at commit."""
    healthy_stub, failing_stub = StubPublisher(latency=0.5), FailingTakeOvers()
    healthy = Relay(eos_config(outbox_url), publisher=healthy_stub)
    failing = Relay(eos_config(outbox_url), publisher=failing_stub)
    with looping(healthy):
        wait_for(lambda: owns_all(healthy))
        with looping(failing):
            wait_for(lambda: failing.health.stepped_aside)
            publish(engine, 5000, keys=100)  # the healthy relay is busy for a while
            time.sleep(1.0)
            assert failing._conn is not None
            pid = failing._conn.info.backend_pid
            with engine.connect() as conn:
                holders = conn.execute(
                    sa.text(
                        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                        "AND classid = CAST(CAST(:space AS bigint) AS oid) AND objsubid = 2"
                    ),
                    {"space": failing.config.spec.wake_lock[0]},
                ).scalars()
                assert pid not in set(holders)


def test_the_last_relay_never_steps_aside(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    failing_stub = FailingTakeOvers()
    failing = Relay(eos_config(outbox_url), publisher=failing_stub)
    with looping(failing):
        wait_for(lambda: failing_stub.failures >= 4, 30)
        assert not failing.health.stepped_aside and failing.step_asides == 0


@pytest.mark.serial
def test_a_relay_that_stepped_aside_comes_back_at_once_when_no_member_is_left(  # type: ignore[no-untyped-def]
    engine, outbox_url, monkeypatch
) -> None:
    """Its pause is long, but the relay that served its share is gone: waiting out the pause
    would leave every shard unowned."""
    from outbox.relay import serving

    monkeypatch.setattr(serving, "STEP_ASIDE_SECONDS", 60.0)
    failing_stub = FailingTakeOvers()
    failing = Relay(eos_config(outbox_url), publisher=failing_stub)
    with looping(failing):
        with looping(Relay(eos_config(outbox_url), publisher=StubPublisher())):
            wait_for(lambda: failing.health.stepped_aside)
        rejoined = time.monotonic()
        wait_for(lambda: not failing.health.stepped_aside, 5)
        assert time.monotonic() - rejoined < 5
        assert failing._ownership is not None and failing._ownership.joined


def test_a_relay_that_stepped_aside_after_its_batches_came_back_is_not_reported_stuck(  # type: ignore[no-untyped-def]
    engine, outbox_url, monkeypatch
) -> None:
    """A's batches came back unsent (lost producers) before its take-overs failed and it
    stepped aside: nothing resets stuck_since while it owns nothing, so /healthz says 'stuck'
    and a supervisor restarts it (losing its step-aside pause and count)."""
    from outbox.relay import marking, serving

    monkeypatch.setattr(serving, "STEP_ASIDE_SECONDS", 30.0)
    monkeypatch.setattr(marking, "LOST_SHARD_HOLD_OFF", 0.3)
    b_stub, a_stub = BreakablePublisher(), BreakablePublisher()
    b = Relay(eos_config(outbox_url), publisher=b_stub)
    a = Relay(eos_config(outbox_url), publisher=a_stub)
    a.health.stale_after = 3.0  # 30 s or more for real; the pause runs up to 160 s
    with looping(b):
        wait_for(lambda: serves_all(b))
        with looping(a):
            wait_for(lambda: a._ownership is not None and len(a._ownership.owned) == 8)
            a_stub.decide = lambda record: "lost"
            a_stub.fail = True
            publish(engine, 400, keys=100)
            wait_for(lambda: a.health.stepped_aside, 10)
            wait_for(lambda: statuses(engine) == {"sent": 400}, 10)
            time.sleep(a.health.stale_after + 0.5)
            assert a.health.stepped_aside
            assert a.health.alive, "stepped aside, yet reported " + a.health.not_alive_because()


def test_a_relay_back_early_from_stepping_aside_stays_in_after_a_reconnect(  # type: ignore[no-untyped-def]
    engine, outbox_url, monkeypatch
) -> None:
    """A steps aside (60 s pause), comes back early because B stopped serving, and its
    take-over works. A later database reconnect must not put it back aside: its pause ends
    with the take-over that worked, or it would stay out (not joined, owning nothing) while
    /readyz says ready."""
    from outbox.relay import serving

    monkeypatch.setattr(serving, "STEP_ASIDE_SECONDS", 60.0)
    b_stub, a_stub = BreakablePublisher(), BreakablePublisher(fail_first=2)
    with a_steps_aside_for_b(outbox_url, b_stub, a_stub) as (a, b):
        b_stub.unreachable = True  # B stops serving: A comes back after the grace
        wait_for(lambda: a.step_asides == 0, 15)  # back, and its take-over worked
        b_stub.unreachable = False
        wait_for(lambda: b._ownership is not None and b._ownership.serving, 15)
        assert a._conn is not None
        pid = a._conn.info.backend_pid
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        wait_for(lambda: a._conn is not None and a._conn.info.backend_pid != pid, 10)
        time.sleep(5)
        assert not a.health.stepped_aside
        assert a._ownership is not None and a._ownership.joined, "healthy A stays out"


def test_one_failed_take_over_a_while_ago_does_not_keep_an_idle_relay_from_serving(  # type: ignore[no-untyped-def]
    engine, outbox_url, monkeypatch
) -> None:
    """B fails one take-over (C died during a blip), then A joins and B's share shrinks back:
    B takes nothing over again. Idle, its probe must make it serve once the failure is old,
    or A, whose take-overs all fail, never steps aside and its share waits unsent."""
    from outbox.relay import serving

    monkeypatch.setattr(serving, "RECENT_FAILURE_SECONDS", 3.0)
    b_stub, c_stub, a_stub = BreakablePublisher(), StubPublisher(), BreakablePublisher()
    a_stub.fail = True
    b = Relay(eos_config(outbox_url), publisher=b_stub)
    a = Relay(eos_config(outbox_url), publisher=a_stub)
    a_joined = threading.Event()

    def blip() -> None:  # B's take-over of C's shards fails once, slowly (init_transactions)
        b_stub.fail = False
        a_joined.wait(15)

    b_stub.on_failure = blip
    with looping(b):
        with looping(Relay(eos_config(outbox_url), publisher=c_stub)) as c:
            wait_for(lambda: c._ownership is not None and len(c._ownership.owned) == 8)
            wait_for(lambda: b._ownership is not None and len(b._ownership.owned) == 8)
            b_stub.fail = True
        wait_for(lambda: b_stub.failures == 1)
        with looping(a):
            wait_for(lambda: a._ownership is not None and a._ownership.joined)
            a_joined.set()
            # B's failure ages, its probe makes it serve, and A steps aside for it.
            wait_for(lambda: a.step_asides == 1 and owns_all(b), 20)
            assert b._ownership is not None and b._ownership.serving
            publish(engine, 100, keys=100)
            wait_for(lambda: statuses(engine) == {"sent": 100}, 10)


class CountingProbes(StubPublisher):
    def __init__(self) -> None:
        super().__init__()
        self.probes = 0

    def check_reachable(self, timeout: float) -> None:
        self.probes += 1


def test_a_relay_whose_batches_get_through_takes_a_dead_relays_shards_without_probing(  # type: ignore[no-untyped-def]
    engine, outbox_url
) -> None:
    """A probe costs a round trip to a broker (more under network latency) before the shards
    of a dead relay get their new owner; a batch acknowledged just now says as much."""
    survivor_stub = CountingProbes()
    survivor = Relay(config(outbox_url), publisher=survivor_stub)
    writing = threading.Event()

    def write_steadily() -> None:
        while writing.is_set():
            publish(engine, 20, keys=20)
            time.sleep(0.05)

    writer = threading.Thread(target=write_steadily)
    with looping(survivor):
        with looping(Relay(config(outbox_url), publisher=StubPublisher())):
            wait_for(lambda: survivor._ownership is not None and survivor._ownership.owned)
            wait_for(lambda: not owns_all(survivor))
            writing.set()
            writer.start()
            wait_for(lambda: survivor.health.kafka_ok and survivor._last_ack > 0)
            probes = survivor_stub.probes
        # The other relay is gone: the survivor, whose batches keep getting through, takes its
        # shards over.
        wait_for(lambda: owns_all(survivor), 5)
        writing.clear()
        writer.join()
        wait_for(lambda: set(statuses(engine)) == {"sent"})
    assert survivor_stub.probes == probes


def test_reads_and_marks_beside_the_owner_session_stop_once_it_is_gone(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    """The relay reads and marks on sessions of its own, naming its owner session by the key
    of a lock that session holds: while it lives, the shards asked for are read and marked;
    once it is gone nothing is, however many other relays' owner sessions live on (and
    whatever shards they hold), and a statement that found it gone leaves no lock behind."""
    import psycopg

    from outbox.schema import SHARD_COUNT

    publish(engine, 400, keys=100)
    spec = OutboxTableSpec()
    store = RelayStore(sender_engine(outbox_url), spec, "guarded")
    conninfo = sa.make_url(outbox_url).set(drivername="postgresql").render_as_string(False)
    owner = psycopg.connect(conninfo, autocommit=True)
    other = psycopg.connect(conninfo, autocommit=True)
    beside = psycopg.connect(conninfo, autocommit=True)
    everything = store.read_batch(list(range(SHARD_COUNT)), 1000)
    shards = sorted({row.shard for row in everything})
    held, elsewhere = shards[:3], shards[3:5]
    key = 12345

    def lock(conn: psycopg.Connection, space: str, number: int) -> None:
        conn.execute("SELECT pg_advisory_lock(%s, %s)", (spec.lock_space(space), number))

    def locks_of(conn: psycopg.Connection) -> int:
        row = beside.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s",
            (conn.info.backend_pid,),
        ).fetchone()
        assert row is not None
        return int(row[0])

    try:
        lock(owner, "session", key)
        for shard in held:
            lock(owner, "shard", shard)
        lock(other, "session", key + 1)
        for shard in elsewhere:
            lock(other, "shard", shard)
        assert store.owner_alive(beside, key)
        read = store.read_batch(held, 1000, beside, 1000, key)
        assert {row.id for row in read} == {row.id for row in everything if row.shard in held}

        acks = [Ack(row.id, 0, n, row.record.generation) for n, row in enumerate(read)]  # type: ignore[union-attr]
        store.record_outcome(acks, connection=beside, owner_key=key)
        assert statuses(engine) == {"sent": len(read), "pending": 400 - len(read)}

        owner.close()  # its locks go with it, once its backend has exited (not at once)
        wait_for(lambda: not store.owner_alive(beside, key), 10)
        assert store.read_batch(list(range(SHARD_COUNT)), 1000, beside, 1000, key) == []
        rest = [
            Ack(row.id, 0, n, row.record.generation)  # type: ignore[union-attr]
            for n, row in enumerate(everything)
            if row.shard not in held
        ]
        store.record_outcome(rest, connection=beside, owner_key=key)
        assert statuses(engine) == {"sent": len(read), "pending": 400 - len(read)}
        assert locks_of(beside) == 0  # the try-lock that found the owner gone was undone
        assert store.owner_alive(beside, key + 1)  # the other relay's owner session lives
    finally:
        for conn in (owner, other, beside):
            conn.close()
        store.engine.dispose()


def test_a_relay_session_that_cannot_see_its_owner_sessions_lock_fails_the_connect(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    """The reads and marks would find nothing for ever on a session that does not see the
    owner session's lock (another server behind the same address): the connect fails."""
    import psycopg

    relay = Relay(config(outbox_url))
    conninfo = sa.make_url(outbox_url).set(drivername="postgresql").render_as_string(False)
    owner = psycopg.connect(conninfo, autocommit=True)
    beside = psycopg.connect(conninfo, autocommit=True)
    try:
        key = relay._take_session_lock(owner)
        relay._check_sees_owner(beside, key)  # the same server: it does
        with pytest.raises(psycopg.OperationalError, match="does not see its owner"):
            relay._check_sees_owner(beside, key + 1)
    finally:
        owner.close()
        beside.close()
        relay.engine.dispose()
