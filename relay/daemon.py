"""The relay loop: read the next rows of idle shards, start sending them, record what ended.

The loop keeps Kafka and PostgreSQL busy at once: while one batch is on its way to Kafka, the
outcome of the last one is recorded and the next one read. A shard has at most one batch in
flight, and its next rows are read only after that batch's outcome is recorded: so nothing is
sent twice by one relay, and a key's messages go in order, also across retries. The owned
shards are read in groups (a quarter of them each), in turn, so that one group's rows are read
while the others' batches are in flight or being marked; a relay that found nothing last time
reads them all at once.

Shards are let go only when nothing is in flight (the loop drains first); gained shards are
taken over in the background (see :mod:`outbox.relay.takeover`) while the others' batches
fly, and read once their take-over ended.
Shutdown (SIGTERM/SIGINT) stops reading, lets the batches in flight finish and be recorded,
releases the shards and exits 0.
"""

from __future__ import annotations

import functools
import gc
import logging
import queue
import signal
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from types import FrameType

import psycopg
from confluent_kafka import KafkaError, KafkaException
from sqlalchemy import exc as sa_exc

from outbox.relay.config import masked_kafka_config
from outbox.relay.observability import mask_secrets, serve
from outbox.relay.policy import ATTEMPTS_EXHAUSTED, RETRIABLE, UNDECODABLE, classify
from outbox.relay.producers import (
    InFlight,
)
from outbox.relay.rebalancing import GAUGE_INTERVAL, Rebalancing
from outbox.relay.serving import (
    FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE,
    FAILED_TAKE_OVERS_FORGOTTEN_SECONDS,
    KAFKA_PROBE_TIMEOUT,
    LONGEST_STEP_ASIDE_SECONDS,
    NOBODY_SERVING_GRACE,
    RECENT_ACK_SECONDS,
    RECENT_FAILURE_SECONDS,
    SERVING_REFRESH_SECONDS,
    STEP_ASIDE_SECONDS,
    UNANSWERED_SECONDS,
    UNREACHABLE_BEFORE_STEPPING_ASIDE,
    Serving,
)
from outbox.relay.sessions import RelaySessions
from outbox.relay.sleeping import HELD_RELOOK_SECONDS, Sleeping
from outbox.relay.state import MARKERS, Ended, RelayState
from outbox.relay.store import (
    Failure,
    HeldRow,
    PendingRow,
    shard_window,
)
from outbox.relay.tracing import start_batch_span
from outbox.sending import Ack, order_gaps

#: The tunables of the loop, importable from here as they always were (each is defined in the
#: module of the mechanism it tunes: patch it there).
__all__ = [
    "FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE",
    "FAILED_TAKE_OVERS_FORGOTTEN_SECONDS",
    "GAUGE_INTERVAL",
    "GC_THRESHOLDS",
    "HELD_RELOOK_SECONDS",
    "KAFKA_PROBE_TIMEOUT",
    "LONGEST_STEP_ASIDE_SECONDS",
    "LOST_SHARD_HOLD_OFF",
    "MARKERS",
    "MARK_RETRY_SECONDS",
    "MAX_ERROR_PAUSE",
    "NOBODY_SERVING_GRACE",
    "READ_GROUPS",
    "RECENT_ACK_SECONDS",
    "RECENT_FAILURE_SECONDS",
    "RECORDING_POLL",
    "SERVING_REFRESH_SECONDS",
    "STEP_ASIDE_SECONDS",
    "UNANSWERED_SECONDS",
    "UNREACHABLE_BEFORE_STEPPING_ASIDE",
    "WAIT_SLICE",
    "Relay",
    "tune_garbage_collector",
]

log = logging.getLogger("outbox.relay")

#: Longest pause after the database or Kafka failed, before trying again.
MAX_ERROR_PAUSE = 10.0
#: Seconds before a relay takes back a shard whose producer could not go on.
LOST_SHARD_HOLD_OFF = 5.0
#: Longest wait for a batch in flight before the loop looks at its stop flag and clocks again.
WAIT_SLICE = 0.2
#: The wait for an outcome being recorded while batches are in flight: Kafka's reports
#: are served at least this often meanwhile.
RECORDING_POLL = 0.002
#: The owned shards are read in this many groups, in turn: while one group is read, the
#: others are on their way to Kafka or being marked. Measured on 16 shards (bench.relay_throughput,
#: one relay): four groups send 15-25% more than two, eight about as many as four.
READ_GROUPS = 4
#: Seconds between tries of a mark whose rows another transaction holds locked (a try waits
#: for no lock): the rows are marked this long at most after the lock goes.
MARK_RETRY_SECONDS = 0.5
#: Garbage collector thresholds of the relay process (see tune_garbage_collector).
GC_THRESHOLDS = (50_000, 20, 100)


def tune_garbage_collector() -> None:
    """Collect cycles less often than Python's default (every 700 new objects).

    A batch makes thousands of objects that live until its outcome is recorded, so the
    default thresholds run full collections over every live object many times a second:
    measured, a third of the loop's time with exactly-once batches. The relay makes few
    cycles (a constant few hundred objects, however many messages it sends); the objects
    that exist when this is called (the modules loaded) are frozen out of the scans.

    Process-wide: ``outbox relay`` calls it; an application that embeds a relay decides.
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class Relay(RelaySessions, Rebalancing, Serving, Sleeping, RelayState):
    """One relay instance. ``run()`` blocks until :meth:`stop` (or a signal) and returns 0."""

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to finish the batch in hand and exit."""
        if not self._stop.is_set():
            self._stop_requested_at = time.monotonic()
        self._stop.set()
        self.health.stopping = True

    def _shutdown_overdue(self) -> bool:
        """A stop was asked for and the batch in hand had its share of the shutdown time."""
        return (
            self._stop.is_set()
            and time.monotonic() - self._stop_requested_at > self.config.shutdown_timeout / 2
        )

    def install_signal_handlers(self) -> None:
        def handle(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %s: finishing the batch in hand, then stopping", signum)
            self.stop()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def run(self) -> int:
        server = None
        if self.config.metrics_port is not None:
            server = serve(
                self.config.metrics_host, self.config.metrics_port, self.metrics, self.health
            )
            self.metrics_server_port = server.server_port
            log.info(
                "metrics and health on http://%s:%d", self.config.metrics_host, server.server_port
            )
        log.info(
            "relay %s starting: %s, table %s, batch %d, kafka %s",
            self.owner,
            self.config.mode,
            self.config.spec.qualified_name,
            self.config.batch_size,
            masked_kafka_config(self.config.kafka),
        )
        pause = 0.5
        exit_code = 0
        try:
            while not self._stop.is_set():
                try:
                    self._connect()
                    self._maybe_rebalance()
                    busy = self._step()
                    self.health.tick()
                    self.health.working_since(
                        self._oldest_unfinished(), self._oldest_mark_or_take_over()
                    )
                    pause = 0.5
                    assert self._wake is not None
                    if busy:
                        # Busy: look again at once, and let writers commit without notifying.
                        self._wake.busy()
                    elif self.health.stepped_aside or not self._owns_shards():
                        # Owning no shard, it must not watch for the others: writers would
                        # notify at every commit while they work.
                        self._wake.away()
                        self._stop.wait(self._sleep_timeout())
                    else:
                        self._wake.idle(self._idle_timeout())
                except (
                    psycopg.OperationalError,
                    sa_exc.OperationalError,
                    sa_exc.InterfaceError,
                ) as error:
                    self._lost_database(error)
                    self._stop.wait(pause)
                    pause = min(MAX_ERROR_PAUSE, pause * 2)
                except (KafkaException, TimeoutError) as error:
                    self.health.kafka_ok = False
                    self._give_up_watch()
                    self._not_serving()
                    # TimeoutError: Kafka did not answer in time (progress reads in a take-over).
                    if (
                        isinstance(error, KafkaException)
                        and error.args[0].code() == KafkaError._INVALID_ARG
                    ):
                        # A setting Kafka's client refuses: no retry will change it.
                        log.critical("Kafka client settings refused: %s", error.args[0].str())
                        exit_code = 1
                        break
                    log.error("Kafka error: %s; retrying in %.1fs", mask_secrets(str(error)), pause)
                    self._stop.wait(pause)
                    pause = min(MAX_ERROR_PAUSE, pause * 2)
        finally:
            self._shutdown()
            if server is not None:
                server.shutdown()
        return exit_code

    # -- the steps ---------------------------------------------------------------------------

    def _step(self) -> bool:
        """Record the batches that ended, start the next one if shards are idle, else wait for
        one in flight. Returns whether there is work (False: idle, nothing in flight)."""
        assert self._publisher is not None
        self._collect_recordings(block=False)
        self._settle(self._publisher.wait(0))
        self._finish_take_overs()
        started = False if self._stop.is_set() else self._start_next()
        settled = False
        if self._publisher.in_flight and not started:
            if self._recorder.running:
                # An outcome is being recorded: its shards are read again as soon as it is,
                # and Kafka is served between short waits for it.
                settled = self._settle(self._publisher.wait(0))
                if not settled:
                    self._recorder.wait(RECORDING_POLL)
            else:
                settled = self._settle(self._publisher.wait(WAIT_SLICE))
        elif len(self._recorder) and not started:
            # Whichever outcome is recorded first frees its shards: not the oldest one's wait.
            self._recorder.wait(WAIT_SLICE)
            settled = self._collect_recordings(block=False)
        elif len(self._take_overs) and not started:
            # Rows committed to shards being taken over woke nobody: read them when it ends.
            self._take_overs.wait(WAIT_SLICE)
            return True
        # A batch just recorded may have left rows behind it (the batch size, a shard's
        # window): look again before sleeping, since no commit is left to wake this relay.
        return started or settled or self._publisher.in_flight > 0 or len(self._recorder) > 0

    def _start_next(self) -> bool:
        """Read the next rows of idle shards and start sending them; False if there were none.

        Behind (the last read that found rows took as many as it may, in all or of one shard),
        the read waits until a group's worth of the owned shards (see READ_GROUPS) is idle,
        and it takes at most that many: one group is read while the others are in flight or
        being marked; with nothing in flight, a group that holds nothing is followed at once
        by the other idle shards, a group's worth at a time, so that rows that woke the relay
        are never left for the next wake-up. Not behind, every idle shard is read at once: a
        transaction's messages, spread over the shards, go in one batch, and a new row waits
        for one read.
        """
        assert self._ownership is not None and self._publisher is not None
        owned = sorted(self._ownership.owned)
        busy = {shard for shards, _, _ in self._busy_shards.values() for shard in shards}
        busy |= self._take_overs.shards
        idle = [shard for shard in owned if shard not in busy]
        group = max(1, -(-len(owned) // READ_GROUPS))  # shards per group, rounded up
        if not idle or (busy and len(idle) < group):
            return False
        shards = idle
        if len(owned) > 1 and len(idle) > group and self._behind:
            # Groups in turn, so that the batches in flight keep to their own shards.
            first = [s for s in idle if owned.index(s) // group == self._group]
            shards = (first or idle)[:group]
            self._group = (self._group + 1) % READ_GROUPS
        started = time.monotonic()
        batch = self._read(shards, group)
        rest = [shard for shard in idle if shard not in shards] if not busy else []
        while not batch and rest:
            # A group's worth at a time: rows found in one group go while the next is read.
            shards, rest = rest[:group], rest[group:]
            batch = self._read(shards, group)
        if batch or not busy:  # (empty shards read beside a batch in flight say nothing)
            # As many rows as the read may take, in all or of one shard: a backlog, read a
            # group at a time so that several batches are in flight. Fewer: rows are read as
            # they are written, every idle shard at once, so that a new row waits for one
            # read, not one a group.
            size, per_shard = self._limits(len(shards), group)
            most_of_one = max(Counter(row.shard for row in batch).values(), default=0)
            self._behind = len(batch) >= size or most_of_one >= per_shard
        if not batch:
            self.health.batch_done(progressed=True)  # nothing to send is not being stuck
            return False
        undecodable = [
            Failure(row.id, UNDECODABLE, row.problem or UNDECODABLE, None)
            for row in batch
            if row.record is None
        ]
        if undecodable:
            self._collect_recordings(block=True)  # a transaction: alone on the session
            try:
                with self.health.marking():
                    self.store.record_outcome([], undecodable, connection=self._conn)
            except psycopg.errors.LockNotAvailable:
                # Another transaction holds one of them locked (MARK_LOCK_TIMEOUT_MS): they
                # stay pending, to be read and recorded again; the loop goes on.
                log.warning("recording %d undecodable rows waits for a row lock", len(undecodable))
            else:
                self._observe_failures(undecodable, {row.id: "?" for row in batch})
        records = [row.record for row in batch if row.record is not None]
        if not records:
            return True
        for row in batch:
            if row.record is not None:
                self._rows[row.id.int] = row
        for flight in self._publisher.start(records):
            in_flight = {record.shard for record in flight.records}
            # A trace span per batch, linked to its messages' contexts (with OpenTelemetry).
            self._busy_shards[flight] = (in_flight, started, start_batch_span(flight.records))
        self.metrics.batch_size.observe(len(batch))
        return True

    def _read(self, shards: list[int], group: int) -> list[PendingRow]:
        """The next rows of ``shards``; each shard's window is a group-read's (``group``
        shards), however many shards are read.

        Caught up, a read is skipped when a look found each of the shards empty and nothing
        but the relay's own marks has committed since (see :mod:`outbox.relay.quiet`): most
        reads of a relay that keeps up find nothing, and the snapshot costs the database a
        fraction of a read."""
        size, per_shard = self._limits(len(shards), group)
        if self._behind:
            self._quiet.drop(shards)  # their rows may be taken and marked: no look stands
            return self.store.read_batch(shards, size, self._reader, per_shard, self._owner_key)
        assert self._reader is not None
        snapshot = self.store.snapshot(self._reader)
        now = time.monotonic()
        if self._quiet.unchanged(shards, snapshot, now, per_shard):
            return []
        batch = self.store.read_batch(shards, size, self._reader, per_shard, self._owner_key)
        found = (row.shard for row in batch)
        self._quiet.saw(shards, found, snapshot, now, len(batch) < size, per_shard)
        return batch

    def _limits(self, shards: int, group: int) -> tuple[int, int]:
        """The most rows a read of ``shards`` shards takes, in all and of one shard."""
        if self.config.exactly_once:
            # A Kafka transaction per shard: each may take a whole batch, so that a backlog
            # costs as few transactions (and their commit round trips) as it can.
            return self.config.batch_size * shards, self.config.batch_size
        return self.config.batch_size, shard_window(self.config.batch_size, group)

    def _settle(self, flights: Sequence[InFlight]) -> bool:
        """Record the outcome of batches that ended, in one statement where possible: in the
        background when they were all acknowledged (see :mod:`outbox.relay.recording`)."""
        # Batches of a connection that was lost meanwhile are forgotten: their rows are read
        # again (or, exactly-once, marked from the progress record by the next owner).
        flights = [flight for flight in flights if flight in self._busy_shards]
        if not flights:
            return False
        ended = Ended(flights, datetime.now(UTC))
        for flight in flights:
            result = flight.result
            ended.acks.extend(result.acks)
            for record_id, error in result.errors.items():
                ended.failures.append(
                    self._failure(self._rows[record_id.int], classify(error), error.str())
                )
            ended.lost_shards.extend(result.lost_shards)
            ended.gaps.extend(
                order_gaps(flight.records, result, lambda e: classify(e) == RETRIABLE)
            )
        # Rows not attempted (a shutdown, an aborted transaction) are still pending, untouched:
        # they are read again.
        if ended.failures:
            # In the background too, on a marking session: another transaction's row lock on
            # one of the rows holds up this batch's shards only (see _record_failures).
            record = functools.partial(
                self._record_failures, self._free_markers, ended, self._owner_key
            )
            self._recorder.submit(ended, record)
        elif ended.acks:
            # Kafka answered now, however long the mark takes: a batch being marked is not
            # one that Kafka leaves unanswered (see _refresh_serving).
            self._last_ack = self._last_reached = time.monotonic()
            # Bound to these sessions: a mark never runs on the next ones, whose owner
            # session may not hold the shards.
            record = functools.partial(self._mark, self._free_markers, ended, self._owner_key)
            self._recorder.submit(ended, record)
        else:
            self._finish(ended)  # nothing to record: every row stays pending, untouched
        return True

    def _mark(
        self, free: queue.SimpleQueue[psycopg.Connection], ended: Ended, owner_key: int
    ) -> float | None:
        """Mark ``ended``'s acknowledgements sent on a free marking session (run by a
        recorder's worker: there are as many workers as sessions, so one is always free).

        Returns None once every row is marked; else (rows another transaction holds locked)
        the seconds after which to try again: the batch stays being recorded, its rows'
        shards busy, so that nothing of them is read and sent again meanwhile."""
        session = free.get_nowait()
        try:
            xid, held = self._try_mark(ended, session, owner_key)
        finally:
            free.put(session)
        if xid is not None:
            # Known as soon as it committed: the loop's next look may come before it collects
            # this batch.
            self._quiet.own(xid)
        ended.held = held
        return MARK_RETRY_SECONDS if held else None

    def _record_failures(
        self, free: queue.SimpleQueue[psycopg.Connection], ended: Ended, owner_key: int
    ) -> float | None:
        """Record ``ended``'s failures and acknowledgements on a free marking session (run by
        a recorder's worker), waiting for no row lock. Returns None once every row is
        recorded; else (rows another transaction holds locked) the seconds after which to
        try again: the shards of those rows stay busy meanwhile, so that nothing of them is
        read and sent again, and the batch's other shards go on."""
        acks, failures = ended.unrecorded or (ended.acks, ended.failures)
        session = free.get_nowait()
        try:
            held = self.store.record_unlocked(acks, failures, session, owner_key)
        except psycopg.errors.LockNotAvailable:
            held = None  # the table is locked (a migration, say): nothing was recorded
        finally:
            free.put(session)
        if not held and held is not None:
            if ended.unrecorded is not None:
                log.warning("recorded the outcome of the rows other transactions held locked")
            return None
        if held is not None:
            ids = {row_id for row_id, _, _ in held}
            acks = [ack for ack in acks if ack.id in ids]
            failures = [failure for failure in failures if failure.id in ids]
            if ended.unrecorded is None:
                self.metrics.marks_blocked.inc()
                log.warning(
                    "recording the outcome of %d rows waits for row locks of other "
                    "transactions (pids %s): shards %s wait until they go; the batch's other "
                    "rows were recorded",
                    len(held),
                    sorted({pid for _, _, pid in held if pid is not None}),
                    sorted({shard for _, shard, _ in held}),
                    extra={"message_ids": [str(row_id) for row_id, _, _ in held]},
                )
            ended.held_shards = {shard for _, shard, _ in held}
        ended.unrecorded = (acks, failures)
        return MARK_RETRY_SECONDS

    def _try_mark(
        self, ended: Ended, session: psycopg.Connection, owner_key: int
    ) -> tuple[int | None, list[HeldRow]]:
        """One try of ``_mark``: the id of the transaction that marked, and the rows left."""
        if ended.held is None:
            try:
                return self.store.mark_acked(ended.acks, session, owner_key), []
            except psycopg.errors.LockNotAvailable:  # see MARK_LOCK_TIMEOUT_MS
                self.metrics.marks_blocked.inc()
            held = [HeldRow(ack, self._rows[ack.id.int].shard, None) for ack in ended.acks]
        else:
            held = ended.held
        try:
            xid, left = self.store.mark_unlocked([h.ack for h in held], session, owner_key)
        except psycopg.errors.LockNotAvailable:
            return None, held  # the table is locked (a migration, say): nothing was marked
        if left and ended.held is None:
            log.warning(
                "marking %d sent rows waits for row locks of other transactions (pids %s):"
                " shards %s wait until they go; the batch's other rows were marked",
                len(left),
                sorted({h.pid for h in left if h.pid is not None}),
                sorted({h.shard for h in left}),
                extra={"message_ids": [str(h.ack.id) for h in left]},
            )
        elif not left and ended.held is not None:
            log.warning("marked the %d rows other transactions' row locks held back", len(held))
        return xid, left

    def _collect_recordings(self, block: bool) -> bool:
        """Finish the batches whose outcome the background recorded (with ``block``, every
        one being recorded, waiting for them). Returns whether any was finished."""
        finished = False
        for ended in self._recorder.collect(block):
            self._finish(ended)
            finished = True
        for ended in self._recorder.retrying():
            # Recorded but for rows another transaction holds locked: the shards of the
            # recorded rows go on (in place: the busy shards are read from these sets).
            if ended.unrecorded is not None:
                if ended.held_shards is None:
                    continue  # the table was locked: nothing of it recorded yet
                held = ended.held_shards
            else:
                held = {h.shard for h in ended.held or ()}
            for flight in ended.flights:
                self._busy_shards[flight][0].intersection_update(held)
        return finished

    def _finish(self, ended: Ended) -> None:
        """A batch's outcome is recorded: its shards are idle again."""
        assert self._publisher is not None and self._ownership is not None
        now = time.monotonic()
        for flight in ended.flights:
            _, began, end_span = self._busy_shards.pop(flight)
            self.metrics.batch_seconds.observe(now - began)
            end_span()
        if ended.lost_shards:
            # Unlocked, not just forgotten: the advisory lock is re-entrant, so a shard locked
            # again later while still held would stay locked after the next release. Not taken
            # back here for a while: its take-over may block while Kafka is unwell, and another
            # relay may serve it meanwhile.
            log.warning("letting go of shards %s: their producer cannot go on", ended.lost_shards)
            self._publisher.let_go(ended.lost_shards)
            self._ownership.release(ended.lost_shards, hold_off=LOST_SHARD_HOLD_OFF)
        if ended.gaps:
            self.metrics.order_gaps.inc(len(ended.gaps))
            log.error(
                "%d messages were acknowledged after an earlier message of their key failed",
                len(ended.gaps),
                extra={"message_ids": [str(g) for g in ended.gaps]},
            )
        acks, failures = ended.acks, ended.failures
        self.health.batch_done(progressed=bool(acks or failures) or self._stop.is_set())
        if acks:
            self.health.kafka_ok = True
            self._last_ack = self._last_reached = now
            self._ownership.mark_serving()
        elif ended.lost_shards or any(failure.delay is not None for failure in failures):
            self._ownership.mark_failing()  # nothing got through, and it will be retried
        self._observe(acks, failures, ended.acked_at)
        for flight in ended.flights:
            for record in flight.records:
                self._rows.pop(record.id.int, None)
        self.batches += len(ended.flights)

    def _drain(self, wait_for_held: bool = True) -> None:
        """Wait for every batch in flight and record it (before ownership changes). Outcomes
        waiting for another transaction's row lock are waited for only with
        ``wait_for_held`` (and until the shutdown is overdue): their shards stay busy, and
        must not change hands (see :meth:`_held_shards`)."""
        assert self._publisher is not None
        self._finish_take_overs(wait_for_all=True)
        while self._publisher.in_flight:
            self._settle(self._publisher.wait(WAIT_SLICE))
        self._collect_recordings(block=True)
        while wait_for_held and len(self._recorder) and not self._shutdown_overdue():
            # A mark waiting for another transaction's row lock: its shards change hands
            # only once it is marked (else their next owner would send its rows again).
            self._recorder.wait(WAIT_SLICE)
            self._collect_recordings(block=True)

    def _held_shards(self) -> set[int]:
        """The shards still busy after a drain: their rows' outcome waits for another
        transaction's row lock. They change hands only once it is recorded (their next owner
        would send the rows again), so a rebalance keeps them meanwhile."""
        return set().union(*(shards for shards, _, _ in self._busy_shards.values()))

    def _failure(self, row: PendingRow, kind: str, error: str) -> Failure:
        if kind == RETRIABLE and not self.config.retry.gives_up(row.attempts):
            return Failure(row.id, RETRIABLE, error, self.config.retry.delay(row.attempts))
        return Failure(row.id, ATTEMPTS_EXHAUSTED if kind == RETRIABLE else kind, error, None)

    def _observe(
        self, acks: Sequence[Ack], failures: Sequence[Failure], acked_at: datetime
    ) -> None:
        """Count what a batch sent and how long each message waited (one pass: it runs on
        the loop for every message)."""
        rows, observe = self._rows, self.metrics.commit_to_ack.observe
        topics: list[str] = []
        for ack in acks:
            row = rows.get(ack.id.int)
            if row is not None and row.record is not None:
                topics.append(row.record.topic)
                observe((acked_at - row.created_at).total_seconds())
        for topic, count in Counter(topics).items():
            self.metrics.published.labels(topic).inc(count)
        self._observe_failures(failures, {f.id: self._topic_of(f.id) for f in failures})

    def _topic_of(self, row_id: uuid.UUID) -> str:
        row = self._rows.get(row_id.int)
        return row.record.topic if row is not None and row.record is not None else "?"

    def _observe_failures(self, failures: Sequence[Failure], topics: dict[uuid.UUID, str]) -> None:
        for failure in failures:
            topic = topics.get(failure.id, "?")
            if failure.delay is None:
                self.metrics.dead.labels(topic, failure.kind).inc()
                log.error(
                    "message dead: %s",
                    failure.error,
                    extra={"message_id": str(failure.id), "topic": topic, "reason": failure.kind},
                )
            else:
                self.metrics.retried.labels(topic).inc()
                log.warning(
                    "message will be retried in %.1fs: %s",
                    failure.delay,
                    failure.error,
                    extra={"message_id": str(failure.id), "topic": topic},
                )

    def _oldest_unfinished(self) -> float | None:
        """When the oldest batch (in flight or being marked) or take-over still running
        began: one that never ends wedges its shards while the others go on."""
        began = [began for _, began, _ in self._busy_shards.values()]
        began.append(self._take_overs.oldest_start() or float("inf"))
        oldest = min(began)
        return None if oldest == float("inf") else oldest

    def _oldest_mark_or_take_over(self) -> float | None:
        """When the oldest mark being recorded or take-over still running began."""
        started = (self._recorder.oldest_submitted(), self._take_overs.oldest_start())
        return min((began for began in started if began is not None), default=None)

    def _shutdown(self) -> None:
        released: list[int] = []
        try:
            if self._publisher is not None and self._busy_shards:
                self._drain()  # give_up (half the shutdown timeout) cuts it short
        except Exception as error:  # the rows stay pending: the next owner sends them
            log.warning("batches in flight at shutdown not recorded: %s", error)
        self._recorder.abandon()  # before the shards are let go
        self._take_overs.ended(wait_for_all=True)
        self._take_overs.close()
        try:
            if self._ownership is not None and self._conn is not None and not self._conn.closed:
                released = self._ownership.release_all()
                if self._wake is not None:
                    self._wake.away()  # an idle relay in this one's care takes the watch
        except psycopg.Error:
            pass  # the locks go with the connection anyway
        self._recorder.close()
        if self._publisher is not None:
            self._publisher.close()
        for session in self._sessions():
            session.close()
        self.store.close()
        self.engine.dispose()
        log.info(
            "relay %s stopped after %d batches; released shards %s",
            self.owner,
            self.batches,
            released,
        )
