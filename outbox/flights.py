"""Several batches in flight on one idempotent producer: the at-least-once sending core.

The relay keeps the producer busy while it records the last outcome and reads the next rows:
a batch is *started* (produced) and *settled* later, when Kafka has answered for each of its
records. :class:`IdempotentSender` is shared by the relay and the immediate sender; its
:meth:`~IdempotentSender.publish` is the stop-and-wait form (start one batch, wait for it).

The rules of :mod:`outbox.sending` hold across batches: each batch has its deadline, owned here,
and when the first deadline passes, everything not acknowledged on the producer is purged at
once, the batches after it too. Acknowledgements per partition come in produce order, so what
is acknowledged stays a prefix of each partition's records, whichever batch they belong to.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from outbox.records import OutboxRecord
from outbox.sending import Ack, BatchResult, kafka_error_of, sending_config

log = logging.getLogger(__name__)

_PURGED = {KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT}


@dataclass(eq=False)
class Flight:
    """One batch on its way: its records, what Kafka said so far, and its deadline."""

    records: Sequence[OutboxRecord]
    deadline: float
    timeout: float
    result: BatchResult = field(default_factory=BatchResult)
    outstanding: int = 0
    #: Set when the batch is over: every record acknowledged, failed or given back.
    settled: bool = False
    #: What the caller names the batch by (the relay's own batch).
    tag: object = None

    def done(self) -> bool:
        return self.settled


#: A delivery report as the client's callback queued it: served under the sender's lock.
_Report = tuple[Flight, OutboxRecord, "KafkaError | None", "int | None", "int | None"]


class IdempotentSender:
    """One idempotent producer (acks=all) with any number of batches in flight.

    ``give_up()`` turning true (a shutdown that waited long enough) ends every batch at once:
    what Kafka has not acknowledged is purged and reported ``not_attempted``.

    One thread may start batches while another serves the producer (:meth:`wait`): the
    client's delivery callbacks only queue their reports, and the reports are taken in, the
    batches' deadlines checked and batches started under one lock, which nobody holds while
    waiting for the client. ``clock`` reads the time (``time.monotonic``); ``watchdog``
    purges at a deadline from a thread of its own, for a caller that may not serve the
    producer in time (off for one that serves it all the time).
    """

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        delivery_timeout_ms: int,
        give_up: Callable[[], bool] = lambda: False,
        extra_config: Mapping[str, Any] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        watchdog: bool = True,
        producer_factory: Callable[[dict[str, Any]], Producer] = Producer,
    ) -> None:
        self.delivery_timeout = delivery_timeout_ms / 1000
        self.give_up = give_up
        self.clock = clock
        self.config = {**sending_config(kafka_config, delivery_timeout_ms), **(extra_config or {})}
        self._make_producer = producer_factory
        self.producer = producer_factory(self.config)
        self._flights: list[Flight] = []
        #: Batches that ended and were not handed out by :meth:`wait` yet.
        self._ended: list[Flight] = []
        self._reports: deque[_Report] = deque()
        #: Held while a batch is produced (a purge between two records of a batch would fail
        #: the first and let the later ones be acknowledged), while reports are taken in, and
        #: while the producer is purged.
        self._producing = threading.Lock()
        self._watchdog: _DeadlineWatchdog | None = (
            _DeadlineWatchdog(self._purge_now) if watchdog else None
        )

    @property
    def in_flight(self) -> int:
        """Batches started and not handed out as ended by :meth:`wait` yet."""
        return len(self._flights) + len(self._ended)

    def start(
        self,
        records: Sequence[OutboxRecord],
        timeout: float | None = None,
        started: float | None = None,
        tag: object = None,
    ) -> Flight:
        """Produce ``records`` in order; their reports arrive during :meth:`wait`.

        The batch ends ``timeout`` seconds (the delivery timeout by default) after ``started``
        (a reading of ``clock``; now by default); ``tag`` names it to the caller.
        """
        timeout = self.delivery_timeout if timeout is None else timeout
        began = self.clock() if started is None else started
        flight = Flight(records, began + timeout, timeout, tag=tag)
        with self._producing:
            self._flights.append(flight)
            self._watch()
            for position, record in enumerate(records):
                if not self._produce(flight, record):
                    # The local queue stayed full until the deadline or a shutdown: the rest
                    # of the batch is given back unsent (nothing of it reached the producer).
                    flight.result.not_attempted.extend(r.id for r in records[position:])
                    break
            self._take_reports()
            self._settle_finished()
        return flight

    def wait(self, timeout: float) -> list[Flight]:
        """Serve the producer up to ``timeout`` seconds, or until a report arrives; return
        the batches that ended since the last call (in the order they were started)."""
        with self._producing:
            self._take_reports()
            self._settle_finished()
            if self._ended:
                timeout = 0.0
            elif self._flights:
                first_deadline = min(f.deadline for f in self._flights)
                timeout = max(0.0, min(timeout, first_deadline - self.clock()))
        failed = _failure_of(lambda: self.producer.poll(timeout))
        with self._producing:
            self._take_reports()
            if failed is not None:
                self._replace(failed.str())
            # Only a batch still waiting for Kafka (or purged by the watchdog) at its deadline
            # ends the batches in flight: one acknowledged in full is not overdue.
            if self._flights and (self._overdue() or self.give_up()):
                self._end_all(stopping=self.give_up())
            self._settle_finished()
            ended, self._ended = self._ended, []
        return ended

    def publish(self, records: Sequence[OutboxRecord]) -> BatchResult:
        """Produce ``records`` and wait for Kafka's word on each (stop-and-wait)."""
        flight = self.start(records)
        while not flight.done():
            self.wait(1.0)
        return flight.result

    def serve_events(self) -> None:
        failed = _failure_of(lambda: self.producer.poll(0))
        if failed is not None:
            with self._producing:
                self._replace(failed.str())

    def limit_batches(self, size: int, why: str) -> None:
        """Keep the producer's requests to ``size`` bytes a partition from now on: a new
        producer takes over (what the old one did not acknowledge is given back)."""
        with self._producing:
            if int(self.config.get("batch.size", 1_000_000)) <= size:
                return
            self.config["batch.size"] = size
            self._replace(why)
            self._settle_finished()

    @property
    def batch_bytes(self) -> int:
        """The most bytes of one partition's records in one request."""
        return int(self.config.get("batch.size", 1_000_000))

    def check_reachable(self, timeout: float) -> None:
        try:
            self.producer.list_topics(timeout=timeout)
        finally:
            self.serve_events()

    def purge(self) -> None:
        """Stop sending now (this relay lost its shards): what is unacknowledged is given back."""
        with self._producing:
            if self._flights:
                self._end_all(stopping=True)
                self._settle_finished()

    def close(self, timeout: float = 30.0) -> None:
        """Wait up to ``timeout`` for what the producer still sends, unless it failed for
        good (then nothing of it is waited for: its rows stay pending)."""
        if self._watchdog is not None:
            self._watchdog.stop()
        failed = _failure_of(lambda: self.producer.flush(timeout))
        if failed is not None:
            log.info("the producer closed as it stands: %s", failed.str())

    # -- internals -------------------------------------------------------------------------

    def _produce(self, flight: Flight, record: OutboxRecord) -> bool:
        while True:
            try:
                self.producer.produce(
                    record.topic,
                    value=record.value,
                    key=record.key,
                    headers=record.kafka_headers,
                    on_delivery=functools.partial(self._report, flight, record),
                )
                flight.outstanding += 1
                return True
            except BufferError:
                # The earliest deadline, not this batch's: the purge that it calls for waits
                # until this batch is produced, and must come before librdkafka's own timeout.
                if self.clock() >= self._first_deadline() or self.give_up():
                    return False
                self.producer.poll(0.05)  # the local queue is full: let deliveries drain it
                self._take_reports()
            except KafkaException as exc:
                # Refused before it was sent (too large for the client, say): its own error.
                flight.result.errors[record.id] = exc.args[0]
                flight.result.refused_alone.add(record.id)
                return True

    def _first_deadline(self) -> float:
        return min((f.deadline for f in self._flights), default=float("inf"))

    def _report(
        self, flight: Flight, record: OutboxRecord, error: KafkaError | None, message: Message
    ) -> None:
        """The client's delivery callback (on whichever thread serves it): queued only."""
        self._reports.append((flight, record, error, message.partition(), message.offset()))

    def _take_reports(self) -> None:
        """Take in the queued reports (under the lock)."""
        while self._reports:
            flight, record, error, partition, offset = self._reports.popleft()
            if flight.settled or flight.outstanding <= 0:
                continue  # the batch was ended already (purged, or its producer replaced)
            flight.outstanding -= 1
            if error is None and partition is not None and offset is not None:
                flight.result.acks.append(Ack(record.id, partition, offset, record.generation))
            else:
                flight.result.errors[record.id] = error or KafkaError(KafkaError._FAIL, "no offset")

    def _end_all(self, stopping: bool) -> None:
        """A deadline passed (or a shutdown gave up): purge everything unacknowledged, in
        every batch, so that no later record of a key can be acknowledged after it."""
        self._guarded(lambda: self.producer.purge(in_queue=True, in_flight=True))
        self._guarded(lambda: self.producer.flush(5))  # runs the purged messages' reports
        self._take_reports()
        for flight in self._flights:
            purged = [rid for rid, err in flight.result.errors.items() if err.code() in _PURGED]
            for record_id in purged:
                flight.result.errors.pop(record_id)
                if stopping:
                    flight.result.not_attempted.append(record_id)
                else:
                    flight.result.errors[record_id] = KafkaError(
                        KafkaError._TIMED_OUT, f"not acknowledged within {flight.timeout:.0f}s"
                    )
            flight.outstanding = 0
        self._watch()

    def _settle_finished(self) -> None:
        """Move the batches Kafka has answered for (or that were ended) to the ended list."""
        finished = [f for f in self._flights if f.outstanding <= 0]
        if not finished:
            return
        self._flights = [f for f in self._flights if f.outstanding > 0]
        for flight in finished:
            flight.settled = True
        self._ended.extend(finished)
        if any(_fatal(e) for f in finished for e in f.result.errors.values()):
            self._replace("a delivery failed with a fatal error")  # ends the other batches
            for flight in self._flights:
                flight.settled = True
            self._ended.extend(self._flights)
            self._flights = []
        self._watch()

    def _watch(self) -> None:
        if self._watchdog is not None:
            self._watchdog.watch(min((f.deadline for f in self._flights), default=None))

    def _purge_now(self) -> None:
        """The watchdog's call at a deadline the caller may be too busy to meet: purge at
        once, so that librdkafka never times messages out one by one. The next :meth:`wait`
        turns the purged reports into timeouts. Never while a batch is being produced.

        The reports that arrived are taken in first: a batch Kafka acknowledged in full while
        the caller was busy is not overdue, and purging at its deadline would fail the
        batches after it (charging their messages an attempt). Only an overdue batch that
        still waits for Kafka purges; otherwise the watch moves to the next deadline."""
        with self._producing:
            self._guarded(lambda: self.producer.poll(0))
            self._take_reports()
            if self._overdue():
                self.producer.purge(in_queue=True, in_flight=True)
            elif self._watchdog is not None:
                waiting = (f.deadline for f in self._flights if f.outstanding > 0)
                self._watchdog.watch(min(waiting, default=None))

    def _overdue(self) -> bool:
        """A batch's deadline passed while it still waits for Kafka (or was purged)."""
        now = self.clock()
        return any(
            flight.deadline <= now
            and (
                flight.outstanding > 0
                or any(error.code() in _PURGED for error in flight.result.errors.values())
            )
            for flight in self._flights
        )

    def _guarded(self, call: Callable[[], object]) -> None:
        """Run a producer call (under the lock); a fatal error raised from it ends every
        batch in flight."""
        failed = _failure_of(call)
        if failed is not None:
            self._replace(failed.str())

    def _replace(self, reason: str) -> None:
        """The idempotent producer cannot go on: what it did not acknowledge is given back
        unsent (the failures it reported for the producer's own state, fatal or purged, are
        not the messages' own), and a new producer takes over.

        The old one is purged and its reports served first: after a fatal error librdkafka
        reports the records of the request that caused it (refused as too large, say) only
        at a later poll, and those are the records' own."""
        log.warning("the idempotent producer failed for good (%s); starting a new one", reason)
        old = self.producer
        _failure_of(lambda: old.purge(in_queue=True, in_flight=True))
        _failure_of(lambda: old.flush(2))
        self._take_reports()
        for flight in [*self._flights, *self._ended]:
            for record_id, error in list(flight.result.errors.items()):
                if _fatal(error) or error.code() in _PURGED:
                    del flight.result.errors[record_id]
                    flight.result.not_attempted.append(record_id)
        for flight in self._flights:
            done = {ack.id for ack in flight.result.acks} | set(flight.result.errors)
            done.update(flight.result.not_attempted)
            flight.result.not_attempted.extend(r.id for r in flight.records if r.id not in done)
            flight.outstanding = 0
        self.producer = self._make_producer(self.config)


def _failure_of(call: Callable[[], object]) -> KafkaError | None:
    """Run a producer call; the Kafka error it raised (a fatal one: fenced, the gap-less
    guarantee), or None. A delivery report that runs after such an error turns it into a
    SystemError, whose cause is the Kafka error."""
    try:
        call()
    except (KafkaException, SystemError) as exc:
        error = kafka_error_of(exc)
        if error is None:
            raise
        return error
    return None


def _fatal(error: KafkaError) -> bool:
    # A producer already in a fatal state fails later produce() calls with _FATAL, whose own
    # fatal flag is not set.
    return bool(error.fatal()) or error.code() in (KafkaError._FATAL, _GAPLESS)


_GAPLESS = KafkaError._GAPLESS_GUARANTEE


class _DeadlineWatchdog:
    """Calls ``purge`` when the earliest deadline passes, from a thread of its own: the loop
    may be busy in a database statement just then, and librdkafka's own message timeout (30 s
    later) must never come first."""

    def __init__(self, purge: Callable[[], None]) -> None:
        self._purge = purge
        self._deadline: float | None = None
        #: When the thread wakes by itself (None: it waits to be notified).
        self._wakes_at: float | None = None
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="outbox-deadlines", daemon=True)
        self._thread.start()

    def watch(self, deadline: float | None) -> None:
        with self._changed:
            self._deadline = deadline
            # Woken only when it would sleep past the new deadline: a deadline that moved later
            # or went (batches settled, others started) is found when the thread wakes at the
            # time it sleeps until, so a relay that keeps up does not wake it at every batch.
            if deadline is not None and (self._wakes_at is None or deadline < self._wakes_at):
                self._changed.notify()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join(5)

    def _run(self) -> None:
        while self._due():
            # Outside the condition's lock: the purge waits for the producing lock, whose
            # holder may be setting the next deadline.
            try:
                self._purge()
            except Exception:  # the loop's own purge at its next wait() follows anyway
                log.exception("purge at the batch deadline failed")

    def _due(self) -> bool:
        """Wait until the deadline passes (True) or the watchdog is stopped (False)."""
        with self._changed:
            while not self._stopped:
                deadline = self._deadline
                if deadline is None:
                    self._wakes_at = None
                    self._changed.wait()
                    continue
                left = deadline - time.monotonic()
                if left > 0:
                    self._wakes_at = deadline
                    self._changed.wait(left)
                    continue
                self._deadline = None
                self._wakes_at = None
                return True
            return False
