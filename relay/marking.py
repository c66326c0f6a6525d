"""Recording what Kafka answered: rows marked sent, failures retried or dead, shards idle again.

Invariant: a batch's shards stay busy until its outcome is recorded, and a row is marked only
by the relay that holds its shard's lock. Batches that ended are recorded in the background
(:mod:`outbox.relay.recording`), on the marking sessions of the connection they were read on:
each mark is bound to those sessions and to the owner session's key, so it never runs on a
later connection's sessions, and marks nothing once that owner session (with its shards'
locks) is gone. Rows another transaction holds locked are tried again every
:data:`MARK_RETRY_SECONDS`; meanwhile their shards stay busy (the batch's other shards go on),
and a drain before shards change hands either waits for them or leaves them busy, so that
the rebalance keeps them (``_held_shards``): their next owner would send the rows again.

Assumes: :mod:`outbox.relay.reading` registers each batch in ``_busy_shards`` and its rows in
``_rows`` as it starts it; the recorder runs at most one mark per marking session; the loop
collects recorded outcomes before it reads again; :mod:`outbox.relay.sessions` abandons the
recorder before it closes the sessions, and forgets the batches of a lost connection (their
outcomes are not recorded).
"""

from __future__ import annotations

import functools
import logging
import queue
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime

import psycopg

from outbox.relay.policy import ATTEMPTS_EXHAUSTED, RETRIABLE, classify
from outbox.relay.producers import InFlight
from outbox.relay.state import Ended, RelayState
from outbox.relay.store import Failure, HeldRow, PendingRow
from outbox.sending import Ack, order_gaps

log = logging.getLogger("outbox.relay")

#: Seconds before a relay takes back a shard whose producer could not go on.
LOST_SHARD_HOLD_OFF = 5.0
#: Longest wait for a batch in flight before the loop looks at its stop flag and clocks again.
WAIT_SLICE = 0.2
#: Seconds between tries of a mark whose rows another transaction holds locked (a try waits
#: for no lock): the rows are marked this long at most after the lock goes.
MARK_RETRY_SECONDS = 0.5


class OutcomeMarking(RelayState):
    """Recording batches' outcomes (a part of :class:`~outbox.relay.daemon.Relay`)."""

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
            held = self._try_mark(ended, session, owner_key)
        finally:
            free.put(session)
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

    def _try_mark(self, ended: Ended, session: psycopg.Connection, owner_key: int) -> list[HeldRow]:
        """One try of ``_mark``: the rows left, another transaction holding them."""
        if ended.held is None:
            try:
                self.store.mark_acked(ended.acks, session, owner_key)
                return []
            except psycopg.errors.LockNotAvailable:  # see MARK_LOCK_TIMEOUT_MS
                self.metrics.marks_blocked.inc()
            held = [HeldRow(ack, self._rows[ack.id.int].shard, None) for ack in ended.acks]
        else:
            held = ended.held
        try:
            left = self.store.mark_unlocked([h.ack for h in held], session, owner_key)
        except psycopg.errors.LockNotAvailable:
            return held  # the table is locked (a migration, say): nothing was marked
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
        return left

    def _collect_recordings(self, block: bool) -> bool:
        """Finish the batches whose outcome the background recorded (with ``block``, every
        one being recorded, waiting for them). Returns whether any was finished."""
        finished = False
        for ended in self._recorder.collect(block):
            self._finish(ended)
            finished = True
        self._stuck_shards = set()
        for ended in self._recorder.retrying():
            # Recorded but for rows another transaction holds locked: the shards of the
            # recorded rows go on (in place: the busy shards are read from these sets).
            if ended.unrecorded is not None:
                if ended.held_shards is None:
                    continue  # the table was locked: nothing of it recorded yet
                held = ended.held_shards
            else:
                held = {h.shard for h in ended.held or ()}
            self._stuck_shards |= held
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
