"""A relay whose Kafka is a stub: real PostgreSQL, real table source, leases and recorder, and a
sender that answers each batch after a set latency with what ``decide`` says of each record.

For tests of the relay's table side (wake-ups, row locks, retries, shards) that need to choose
Kafka's answers; what needs Kafka's own behaviour runs on the real broker.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from confluent_kafka import KafkaError

from outbox import Message, Outbox
from outbox.records import OutboxRecord
from outbox.relay.commands import Batch
from outbox.relay.config import RelayConfig
from outbox.relay.daemon import Parts, Relay, _real_parts
from outbox.relay.policy import RetryPolicy
from outbox.sending import Ack, BatchResult

#: What the stub says of a record: stored, a retriable error, a permanent error (too large),
#: or not attempted with its shard's producer lost (exactly-once's fatal error).
Verdict = str  # "ack" | "retry" | "dead" | "lost"


class StubSender:
    """Ends each batch ``latency`` seconds after it started, with ``decide(record)``'s verdict
    on each record. As the idempotent producer, nothing of a key is stored after a record of
    that key failed in the same batch."""

    def __init__(self, latency: float = 0.02) -> None:
        self.latency = latency
        #: Seconds a batch takes (``latency`` unless set): a slow partition, say.
        self.latency_of: Callable[[Batch], float] = lambda batch: self.latency
        self.decide: Callable[[OutboxRecord], Verdict] = lambda record: "ack"
        #: While true of a batch whose latency is over, it stays in flight (a batch that does
        #: not end); it ends at the first serve after it turns false.
        self.holds: Callable[[Batch], bool] = lambda batch: False
        #: What a take-over answers (exactly-once: what the shards' last owners committed);
        #: it may raise (Kafka does not answer) or block (a coordinator that hangs).
        self.answer_take_over: Callable[[Sequence[int]], dict[int, list[Ack]]] = lambda s: {}
        self.reachable = True
        self.acked: list[OutboxRecord] = []
        self.log: list[tuple[str, frozenset[int]]] = []  # ("start" | "end", shards)
        self.overlaps = 0  # batches started while another was in flight
        self.offsets = 0
        #: The serve() calls, when each began (time.monotonic()).
        self.serves: list[float] = []
        #: Each batch started: when, and its shards.
        self.starts: list[tuple[float, frozenset[int]]] = []
        self.take_overs: list[tuple[int, ...]] = []
        self.take_over_failures = 0
        self.let_go_shards: list[tuple[int, ...]] = []
        self.stops = 0  # stop_sending() calls
        self.probes = 0
        self._flights: list[tuple[Batch, float]] = []
        self._in_flight_shards: set[int] = set()
        self._lock = threading.Lock()

    # -- the Sender protocol -----------------------------------------------------------------

    def start(self, batch: Batch) -> None:
        with self._lock:
            assert not batch.shards & self._in_flight_shards, "a shard had two batches in flight"
            if self._flights:
                self.overlaps += 1
            self._in_flight_shards |= batch.shards
            now = time.monotonic()
            self._flights.append((batch, now + self.latency_of(batch)))
            self.log.append(("start", batch.shards))
            self.starts.append((now, batch.shards))

    def serve(self, timeout: float) -> list[tuple[Batch, BatchResult]]:
        began = time.monotonic()
        with self._lock:
            self.serves.append(began)
            due = [ends for batch, ends in self._flights if not self.holds(batch)]
        first = min(due, default=began + timeout)
        # A held batch is looked at again within a tenth of a second.
        first = min(first, began + 0.1) if len(due) < len(self._flights) else first
        time.sleep(max(0.0, min(timeout, first - began)))
        ended: list[tuple[Batch, BatchResult]] = []
        with self._lock:
            now = time.monotonic()
            for flight in [f for f in self._flights if f[1] <= now and not self.holds(f[0])]:
                self._flights.remove(flight)
                ended.append((flight[0], self._end(flight[0])))
        return ended

    def take_over(self, shards: Sequence[int]) -> dict[int, list[Ack]]:
        self.take_overs.append(tuple(shards))
        try:
            return self.answer_take_over(shards)
        except BaseException:
            self.take_over_failures += 1
            raise

    def let_go(self, shards: Sequence[int]) -> None:
        self.let_go_shards.append(tuple(shards))

    def stop_sending(self) -> None:
        self.stops += 1

    def probe(self, timeout: float) -> bool:
        self.probes += 1
        return self.reachable

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._flights)

    def close(self) -> None:
        return None

    # -- what tests look at ------------------------------------------------------------------

    def idle(self) -> bool:
        return self.in_flight == 0

    def _end(self, batch: Batch) -> BatchResult:
        result = BatchResult()
        failed_keys: set[tuple[str, bytes | None]] = set()
        for record in batch.records:
            verdict = self.decide(record)
            if record.key is not None and (record.topic, record.key) in failed_keys:
                verdict = "retry"
            if verdict == "ack":
                self.offsets += 1
                result.acks.append(Ack(record.id, 0, self.offsets, record.generation))
                self.acked.append(record)
            elif verdict == "retry":
                failed_keys.add((record.topic, record.key))
                result.errors[record.id] = KafkaError(KafkaError._TIMED_OUT, "stub")
            elif verdict == "dead":
                result.errors[record.id] = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "stub")
                result.refused_alone.add(record.id)
            elif verdict == "lost":
                result.not_attempted.append(record.id)
                if record.shard not in result.lost_shards:
                    result.lost_shards.append(record.shard)
            else:
                raise AssertionError(f"unknown verdict {verdict!r}")
        self._in_flight_shards -= batch.shards
        self.log.append(("end", batch.shards))
        return result


def stub_relay(config: RelayConfig, stub: StubSender, **kwargs: Any) -> Relay:
    """A relay on the real database whose sender is ``stub``."""

    def parts(relay: Relay) -> Parts:
        return dataclasses.replace(_real_parts(relay), make_sender=lambda _relay: stub)

    return Relay(config, parts=parts, **kwargs)


def stub_config(outbox_url: str, **overrides: Any) -> RelayConfig:
    """A relay configuration for a stub sender: Kafka's address is never used."""
    options: dict[str, Any] = {
        "database_url": outbox_url,
        "kafka": {"bootstrap.servers": "127.0.0.1:9"},
        "batch_size": 100,
        "poll_interval": 0.1,
        "rebalance_interval": 0.2,
        "retry": RetryPolicy(max_attempts=3, base_seconds=0.05, cap_seconds=0.1),
    }
    options.update(overrides)
    return RelayConfig(**options)


def publish(engine: sa.Engine, count: int, keys: int, topic: str = "loop") -> list[Any]:
    """``count`` messages over ``keys`` keys, in one transaction; their ids."""
    with Outbox(engine).transaction() as tx:
        results = tx.publish_many(
            [Message(topic, {"n": n}, key=f"k{n % keys}") for n in range(count)]
        )
    return [r.message_id for r in results]


def by_key_in_seq_order(records: Sequence[OutboxRecord]) -> bool:
    """Whether each key's records come in the order they were written."""
    last: dict[bytes | None, int] = {}
    for record in records:
        if record.seq < last.get(record.key, -1):
            return False
        last[record.key] = record.seq
    return True
