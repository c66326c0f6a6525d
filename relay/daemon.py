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
import secrets
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import FrameType
from typing import Any

import psycopg
import sqlalchemy as sa
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from sqlalchemy import exc as sa_exc

from outbox.engines import sender_engine
from outbox.relay.config import RelayConfig, masked_kafka_config
from outbox.relay.observability import HealthState, RelayMetrics, mask_secrets, serve
from outbox.relay.ownership import ShardOwnership
from outbox.relay.policy import ATTEMPTS_EXHAUSTED, RETRIABLE, UNDECODABLE, classify
from outbox.relay.producers import (
    KAFKA_LOG,
    TRANSACTION_MARGIN_MS,
    AtLeastOncePublisher,
    BatchPublisher,
    ExactlyOncePublisher,
    InFlight,
)
from outbox.relay.progress import ensure_progress_topic
from outbox.relay.promotion import ScheduledPromotion
from outbox.relay.quiet import QuietShards
from outbox.relay.recording import OutcomeRecorder
from outbox.relay.store import (
    MARK_LOCK_TIMEOUT_MS,
    Failure,
    HeldRow,
    PendingRow,
    RelayStore,
    shard_window,
)
from outbox.relay.takeover import TakeOvers
from outbox.relay.tracing import start_batch_span
from outbox.relay.wakeup import WakeUp
from outbox.sending import Ack, order_gaps

log = logging.getLogger("outbox.relay")

#: Seconds between refreshes of the oldest-pending gauge.
GAUGE_INTERVAL = 5.0
#: Longest pause after the database or Kafka failed, before trying again.
MAX_ERROR_PAUSE = 10.0
#: Seconds a broker has to answer the metadata request that shows Kafka is in reach.
KAFKA_PROBE_TIMEOUT = 5.0
#: A relay whose batch was acknowledged this many seconds ago or less is in Kafka's reach:
#: it takes shards (a dead relay's, say) without probing first.
RECENT_ACK_SECONDS = 2.0
#: Seconds before a relay takes back a shard whose producer could not go on.
LOST_SHARD_HOLD_OFF = 5.0
#: Take-overs that fail in a row before a relay tries to step aside (leave the members), so
#: that healthy relays take its share instead of the shards waiting for it to recover.
FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE = 2
#: Seconds out of the members the first time; doubled at each step aside in a row, up to
#: the longest. A take-over that works resets both counts.
STEP_ASIDE_SECONDS = 10.0
LONGEST_STEP_ASIDE_SECONDS = 160.0
#: An exactly-once member that has not shown for this long that it reaches Kafka (an
#: acknowledged batch, a take-over, a probe) asks a broker at its next rebalance, when idle:
#: whether it serves must stay true while it idles.
SERVING_REFRESH_SECONDS = 5.0
#: Batches in flight this long with nothing acknowledged: the relay does not serve.
UNANSWERED_SECONDS = 15.0
#: A failed take-over this recent keeps an idle relay's probe from making it serve again;
#: one older than the longest is forgotten when the next one fails.
RECENT_FAILURE_SECONDS = 15.0
FAILED_TAKE_OVERS_FORGOTTEN_SECONDS = 300.0
#: Seconds a relay that stepped aside waits, when members are left but none serves, before
#: it joins again (a blip that turned one batch back is no reason to come back).
NOBODY_SERVING_GRACE = 5.0
#: Seconds a member's probe must keep failing, while it lacks shards of its share, before it
#: steps aside like a relay whose take-overs fail: it takes none while Kafka is out of its
#: reach, and as a member it keeps the others from taking them.
UNREACHABLE_BEFORE_STEPPING_ASIDE = 10.0
#: Longest wait for a batch in flight before the loop looks at its stop flag and clocks again.
WAIT_SLICE = 0.2
#: Longest sleep of an idle relay while an immediate sender holds rows of its shards: the
#: sender's mark wakes nobody, and the held keys' later rows may go once it lands.
HELD_RELOOK_SECONDS = 0.05
#: The wait for an outcome being recorded while batches are in flight: Kafka's reports
#: are served at least this often meanwhile.
RECORDING_POLL = 0.002
#: The owned shards are read in this many groups, in turn: while one group is read, the
#: others are on their way to Kafka or being marked. Measured on 16 shards (bench.relay_throughput,
#: one relay): four groups send 15-25% more than two, eight about as many as four.
READ_GROUPS = 4
#: Sessions that mark batches sent, side by side (four measured as fast as two).
MARKERS = 2
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


@dataclass(eq=False)
class _Ended:
    """Batches that ended together, and what to record of them."""

    flights: Sequence[InFlight]
    acked_at: datetime
    acks: list[Ack] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    lost_shards: list[int] = field(default_factory=list)
    gaps: list[uuid.UUID] = field(default_factory=list)
    #: Rows another transaction held locked at the last try of the mark (None: not tried).
    held: list[HeldRow] | None = None
    #: A batch with failures whose recording waits for other transactions' row locks: what
    #: is left to record (None: not tried yet), and the shards of the rows held (the others
    #: go on).
    unrecorded: tuple[list[Ack], list[Failure]] | None = None
    held_shards: set[int] | None = None


class Relay:
    """One relay instance. ``run()`` blocks until :meth:`stop` (or a signal) and returns 0."""

    def __init__(
        self,
        config: RelayConfig,
        metrics: RelayMetrics | None = None,
        *,
        store: RelayStore | None = None,
        publisher: BatchPublisher | None = None,
    ) -> None:
        """``store`` and ``publisher`` default to the real ones made from ``config``; tests
        pass their own (a publisher standing in for Kafka, say)."""
        self.config = config
        self.owner = f"relay-{uuid.uuid4()}"
        # Not the hot path (that is the owner session): a stale pooled connection after a
        # database restart is replaced instead of failing a take-over or the gauge.
        self.engine = sender_engine(config.database_url, durable=False)
        self.store = store or RelayStore(
            self.engine, config.spec, self.owner, config.delete_on_send
        )
        self.metrics = metrics or RelayMetrics()
        #: Due scheduled messages are made pending before a read (see outbox.relay.promotion).
        self._due = ScheduledPromotion(config.spec, self.metrics)
        # A batch may wait for Kafka up to the delivery timeout, and an exactly-once commit
        # be resumed until its transaction times out, without the loop turning.
        self.health = HealthState(
            stale_after=max(
                30.0,
                5 * config.poll_interval,
                (config.delivery_timeout_ms + TRANSACTION_MARGIN_MS) / 1000 + 30,
            ),
            wedge_after=config.wedge_timeout,
        )
        self._stop = threading.Event()
        self._stop_requested_at = 0.0
        self._conn: psycopg.Connection | None = None
        #: The sessions batches are read and marked on, beside the owner session (``_conn``):
        #: a read waits for no mark, and marks run side by side. Their statements touch nothing
        #: once the owner session is gone, named by the key of a lock it takes when it
        #: connects (``_owner_key``; see the owner_alive query).
        self._reader: psycopg.Connection | None = None
        self._markers: list[psycopg.Connection] = []
        #: The marking sessions not in use: each mark takes one for its statement.
        self._free_markers: queue.SimpleQueue[psycopg.Connection] = queue.SimpleQueue()
        self._owner_key = 0
        self._ownership: ShardOwnership | None = None
        self._wake: WakeUp | None = None
        self._publisher: BatchPublisher | None = publisher
        #: The rows of the batches in flight (by ``id.int``: a UUID's own hash is a Python
        #: call, and there are several lookups per message); the shards each batch holds,
        #: and when it began.
        self._rows: dict[int, PendingRow] = {}
        self._busy_shards: dict[InFlight, tuple[set[int], float, Callable[[], None]]] = {}
        #: Batches that ended, their outcome being recorded (they keep their shards busy).
        self._recorder: OutcomeRecorder[_Ended] = OutcomeRecorder(workers=MARKERS)
        #: Shards gained and being taken over: owned, not read until it ended.
        self._take_overs = TakeOvers()
        #: Which group of the owned shards the next read starts with.
        self._group = 0
        #: The last read that found rows took as many as it may, in all or of one shard (a
        #: backlog): the next reads one group of shards.
        self._behind = False
        #: Shards a look found empty, and as of which snapshot.
        self._quiet = QuietShards()
        self._next_rebalance = 0.0
        self._next_gauge = 0.0
        self._failed_take_overs = 0
        self._last_failed_take_over = float("-inf")
        self._last_ack = float("-inf")
        #: When this relay last showed that it reaches Kafka (an ack, a take-over, a probe).
        self._last_reached = float("-inf")
        self._nobody_serving_since: float | None = None
        self._probed_at = float("-inf")
        #: Since when the probe before taking shards has kept failing (None: it has not).
        self._unreachable_since: float | None = None
        #: Steps aside in a row, and when this relay may join again after the last one.
        self.step_asides = 0
        self._rejoin_at = 0.0
        self.batches = 0
        self.metrics_server_port: int | None = None

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
        assert self._reader is not None
        self._due.promote(self._ownership.owned, self._reader, self._owner_key)
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
        ended = _Ended(flights, datetime.now(UTC))
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
        self, free: queue.SimpleQueue[psycopg.Connection], ended: _Ended, owner_key: int
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
        self, free: queue.SimpleQueue[psycopg.Connection], ended: _Ended, owner_key: int
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
        self, ended: _Ended, session: psycopg.Connection, owner_key: int
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

    def _finish(self, ended: _Ended) -> None:
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

    def _give_up_watch(self) -> None:
        """A relay that cannot publish must not watch for the others (they would only poll)."""
        if self._wake is None or self._conn is None or self._conn.closed:
            return
        try:
            self._wake.away()
        except psycopg.Error as error:
            # Closed with the connection, the locks cannot outlive what this relay knows.
            self._lost_database(error)

    def _not_serving(self) -> None:
        """Kafka failed this relay: no other relay steps aside on its account."""
        if self._ownership is None or self._conn is None or self._conn.closed:
            return
        try:
            self._ownership.mark_failing()
        except psycopg.Error as error:
            self._lost_database(error)

    def _owns_shards(self) -> bool:
        return self._ownership is not None and bool(self._ownership.owned)

    def _sleep_timeout(self) -> float:
        """How long an idle relay may sleep: until the poll interval or the next rebalance."""
        return min(self.config.poll_interval, max(0.0, self._next_rebalance - time.monotonic()))

    def _idle_timeout(self) -> float:
        """How long an idle relay that owns shards may sleep: while an immediate sender holds
        rows of them, a short while only. Its mark, an UPDATE, wakes nobody, and the later
        rows of the held keys (given back, or written without immediate send) may go then.
        It sleeps no longer than until the next scheduled message of its shards is due."""
        timeout = self._due.sleep_bound(self._sleep_timeout())
        assert self._ownership is not None and self._reader is not None
        if timeout > HELD_RELOOK_SECONDS and self.store.leases_held(
            sorted(self._ownership.owned), self._reader
        ):
            return HELD_RELOOK_SECONDS
        return timeout

    def _connect(self) -> None:
        # Kafka first: a publisher that could not be made (broker unreachable) is retried on
        # the next round even when the database connection is already up.
        if self._publisher is None:
            self._publisher = self._make_publisher()
        if self._connected():
            return
        if self._sessions():
            # Broken under a statement whose error the loop has not seen yet (a mark being
            # recorded in the background): let go of what the old session held first.
            self._lost_database(psycopg.OperationalError("the relay's session was closed"))
        opened: list[psycopg.Connection] = []
        try:
            opened.append(self._open_session(self.owner))
            key = self._take_session_lock(opened[0])
            for name in ("read", *["mark"] * MARKERS):
                opened.append(
                    self._open_session(
                        f"{self.owner}/{name}", marking=name == "mark", reading=name == "read"
                    )
                )
                self._check_sees_owner(opened[-1], key)
        except BaseException:
            for session in opened:
                session.close()
            raise
        self._conn, self._reader, *self._markers = opened
        self._owner_key = key
        self._free_markers = queue.SimpleQueue()
        for marker in self._markers:
            self._free_markers.put(marker)
        self._conn.execute(f'LISTEN "{self.config.spec.notify_channel}"')
        self._ownership = ShardOwnership(self._conn, self.config.spec, uuid.uuid4().int % 2**31)
        self._wake = WakeUp(self._conn, self.config.spec)
        self.health.database_ok = True
        self._next_rebalance = 0.0
        log.info("connected; listening on %s", self.config.spec.notify_channel)

    def _take_session_lock(self, conn: psycopg.Connection) -> int:
        """Lock a random key of the session lock space on the owner session: the key names it
        to the reads and marks of the other sessions (see the owner_alive query)."""
        space = self.config.spec.lock_space("session")
        while True:
            key = secrets.randbelow(2**31)
            row = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (space, key)).fetchone()
            if row is not None and row[0]:
                return key

    def _check_sees_owner(self, session: psycopg.Connection, key: int) -> None:
        """A session that cannot see the owner session's lock (another server behind the
        same address, say) would read and mark nothing, for ever: fail the connect instead."""
        if not self.store.owner_alive(session, key):
            raise psycopg.OperationalError(
                "a relay session does not see its owner session's lock: are they on the same"
                " server and database?"
            )

    def _sessions(self) -> list[psycopg.Connection]:
        sessions = [self._conn, self._reader, *self._markers]
        return [session for session in sessions if session is not None]

    def _connected(self) -> bool:
        sessions = self._sessions()
        return len(sessions) == 2 + MARKERS and not any(s.closed for s in sessions)

    def _open_session(
        self, name: str, marking: bool = False, reading: bool = False
    ) -> psycopg.Connection:
        url = sa.make_url(self.config.database_url)
        # Marks join the table to the batch's arrays: hash joins only (see
        # outbox.engines.hash_joins_only). Measured: statistics taken while few rows were
        # pending, and the pending index full of rows marked since the last vacuum, gave a
        # nested loop comparing every row with every id, 0.4-0.5 s per mark at 10,000 msgs/s.
        joins = " -c enable_nestloop=off" if marking else ""
        locks = f" -c lock_timeout={MARK_LOCK_TIMEOUT_MS}" if marking else ""
        # The reading session runs the batch read alone, planned once for any parameters:
        # its plan (a walk of each shard's pending index) is the same for every batch, and
        # planning it again took a read's backend 0.7 of its 1 ms when the relay keeps up
        # (a read every few milliseconds). Other statements are planned for their own
        # parameters: a generic plan of a mark guesses its arrays' sizes wrong (see
        # outbox.engines.sender_engine).
        plans = "force_generic_plan" if reading else "force_custom_plan"
        return psycopg.connect(
            host=url.host or "localhost",
            port=url.port or 5432,
            user=url.username,
            password=url.password,
            dbname=url.database,
            autocommit=True,
            connect_timeout=10,
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=3,
            application_name=name[:63],
            # No sequential scans: right after a TRUNCATE, or before autovacuum analyzes a
            # table that grew fast, the planner takes the table for a small one and scans all
            # of it for each mark (hundreds of milliseconds on a busy table; every statement of
            # these sessions has an index to use).
            # Marks of sent rows: see RelayConfig.marks_wait_for_flush (failures always wait).
            # Set either way: a database or role default must not decide it.
            # The server, too, should notice a vanished relay quickly: drop the owner
            # session's locks, and not keep the other sessions' backends for hours.
            options=f"-c plan_cache_mode={plans} -c jit=off -c enable_seqscan=off"
            + joins
            + locks
            + " -c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3"
            " -c synchronous_commit=" + ("on" if self.config.marks_wait_for_flush else "off"),
        )

    def _make_publisher(self) -> BatchPublisher:
        if not self.config.exactly_once:
            return AtLeastOncePublisher(
                self.config.kafka, self.config.delivery_timeout_ms, self._shutdown_overdue
            )
        settings: dict[str, Any] = {
            k: v
            for k, v in self.config.kafka.items()
            if not k.startswith(("linger", "compression"))
        }
        settings["logger"] = KAFKA_LOG
        admin = AdminClient(settings)
        try:
            ensure_progress_topic(admin, self.config.progress_topic_name)
        finally:
            admin.poll(0)  # hands its log lines over
        return ExactlyOncePublisher(
            self.config.kafka,
            transactional_id_prefix=self.config.transactional_prefix,
            progress_topic=self.config.progress_topic_name,
            owner=self.owner,
            delivery_timeout_ms=self.config.delivery_timeout_ms,
            give_up=self._shutdown_overdue,
        )

    def _maybe_rebalance(self) -> None:
        now = time.monotonic()
        if now < self._next_rebalance:
            return
        assert self._ownership is not None and self._publisher is not None
        self._next_rebalance = now + self.config.rebalance_interval
        # Marks run on sessions of their own, and the shards let go below are drained first
        # (_drain): what is recorded by now is finished, nothing is waited for.
        self._collect_recordings(block=False)
        self._publisher.serve_events()
        self._finish_take_overs()
        if not self._ownership.joined and self._stays_aside(now):
            return  # stepped aside: the others serve its share meanwhile
        if not self._ownership.joined:
            # A relay that cannot publish must not count as a member: each member lowers the
            # others' share, and the shards they let go would wait for it.
            self._publisher.check_reachable(KAFKA_PROBE_TIMEOUT)
            self.health.kafka_ok = True
            self._last_reached = time.monotonic()
            self._ownership.join()
            self.health.stepped_aside = False
        self._refresh_serving(now)
        # A shard changes hands only with no batch of it in flight: the batches in flight
        # finish first when shards are to be let go (gained shards have none).
        gained, lost = self._ownership.rebalance(
            can_serve=self._kafka_reachable,
            before_letting_go=functools.partial(self._drain, wait_for_held=False),
            keep=self._held_shards,
        )
        if self._wake is not None:
            self._wake.alone = self._ownership.member_count <= 1
        if lost:
            self._publisher.let_go(lost)
            log.info("released shards %s", lost)
        if gained:
            self._take_over(gained)
        if (
            self._unreachable_since is not None
            and self._unreachable_since > self._last_reached  # nothing got through since
            and now - self._unreachable_since >= UNREACHABLE_BEFORE_STEPPING_ASIDE
        ):
            self._unreachable_since = None
            self._try_stepping_aside("Kafka stays out of its reach")
        self.metrics.owned_shards.set(len(self._ownership.owned))
        if now >= self._next_gauge:
            self._next_gauge = now + GAUGE_INTERVAL
            self.metrics.oldest_pending.set(self.store.oldest_pending_age())
            self._due.refresh_gauges(self.engine)

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

    def _kafka_reachable(self) -> bool:
        """Probe Kafka before taking shards: a relay out of its reach takes none."""
        assert self._publisher is not None
        if time.monotonic() - self._last_ack <= RECENT_ACK_SECONDS:
            return True  # a batch just got through: no probe to delay the take-over
        try:
            self._publisher.check_reachable(KAFKA_PROBE_TIMEOUT)
        except KafkaException as error:
            log.warning("Kafka out of reach (%s); taking no shards", error.args[0])
            self.health.kafka_ok = False
            self._ownership.mark_failing()  # type: ignore[union-attr]
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
            return False
        self._unreachable_since = None
        self.health.kafka_ok = True
        self._last_reached = time.monotonic()
        return True

    def _take_over(self, shards: list[int]) -> None:
        """Start taking ``shards`` over in the background (see :mod:`outbox.relay.takeover`):
        fence their earlier owner, mark sent what its last committed transactions held."""
        publisher, store = self._publisher, self.store
        assert publisher is not None

        def take_over() -> tuple[int, int]:
            recovered = publisher.take_over(shards)
            return store.mark_committed(recovered), store.break_leases(shards)

        log.info("taking over shards %s", shards)
        self._take_overs.start(shards, take_over)

    def _finish_take_overs(self, wait_for_all: bool = False) -> None:
        """Put the shards of the take-overs that ended to work, or give them back."""
        assert self._publisher is not None and self._ownership is not None
        for take_over in self._take_overs.ended(wait_for_all):
            shards = list(take_over.shards)
            error = take_over.error()
            if error is None and set(shards) <= self._ownership.owned:
                marked, broken = take_over.future.result()
                self._failed_take_overs = self.step_asides = 0
                self._rejoin_at = 0.0
                self._last_reached = time.monotonic()
                self._ownership.mark_serving()
                log.info(
                    "took over shards %s (%d rows marked sent from committed progress, "
                    "%d leases taken back)",
                    shards,
                    marked,
                    broken,
                )
                continue
            # Owning a shard that was not taken over properly would stall it: give the shards
            # back, so that a later rebalance (here or in another relay) tries again.
            self._publisher.let_go(shards)
            self._ownership.release(shards)
            if error is None:
                continue  # let go meanwhile (a step aside)
            if not isinstance(error, KafkaException | TimeoutError):
                raise error  # the database: the loop reconnects
            # TimeoutError: Kafka did not answer in time (progress reads).
            log.error("taking over shards %s failed: %s", shards, mask_secrets(str(error)))
            self.health.kafka_ok = False
            if wait_for_all:
                # Draining before shards change hands: no stepping aside in the middle of it.
                self._ownership.mark_failing()
            else:
                self._take_over_failed()

    def _take_over_failed(self) -> None:
        """Count a take-over that Kafka failed; after a few in a row, step aside if another
        member serves (ShardOwnership.step_aside): this relay's path to Kafka, not Kafka, may
        be what is broken, and its share would otherwise wait for it."""
        assert self._ownership is not None and self._publisher is not None
        self._ownership.mark_failing()
        now = time.monotonic()
        if now - self._last_failed_take_over > FAILED_TAKE_OVERS_FORGOTTEN_SECONDS:
            self._failed_take_overs = 0
        self._last_failed_take_over = now
        self._failed_take_overs += 1
        if self._failed_take_overs >= FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE:
            self._try_stepping_aside("shard take-overs keep failing")

    def _try_stepping_aside(self, why: str) -> None:
        """Step aside if another member serves; else stay and keep trying here."""
        assert self._ownership is not None and self._publisher is not None
        if self._ownership.others_serving() == 0:
            return
        self._drain(wait_for_held=False)  # nothing of a shard may be in flight when it goes
        if self._held_shards():
            return  # an outcome waits for a row lock: stay until it is recorded
        released = self._ownership.step_aside()
        if released is None:
            return  # nobody else serves: keep trying here
        self._publisher.let_go(released)
        pause = min(LONGEST_STEP_ASIDE_SECONDS, STEP_ASIDE_SECONDS * 2**self.step_asides)
        self.step_asides += 1
        # Back in, one more failed take-over sends it aside again: each return costs the
        # healthy relays a hand-over and leaves its share unsent while the take-over fails.
        self._failed_take_overs = FAILED_TAKE_OVERS_BEFORE_STEPPING_ASIDE - 1
        self._nobody_serving_since = None
        self._rejoin_at = time.monotonic() + pause
        self.health.stepped_aside = True
        self.health.batch_done(progressed=True)  # owning nothing, it has nothing to be stuck on
        self.metrics.owned_shards.set(0)
        log.warning(
            "%s: stepping aside for up to %.0fs (released shards %s) so that the other relays "
            "take them",
            why,
            pause,
            released,
        )

    def _stays_aside(self, now: float) -> bool:
        """A relay that stepped aside stays out until its pause ends, unless its share has
        nobody to send it: no member left (at once), or none serving for a few seconds."""
        assert self._ownership is not None
        if now >= self._rejoin_at:
            return False
        if self._ownership.others_serving() > 0:
            self._nobody_serving_since = None
            return True
        if self._ownership.other_members() == 0:
            return False
        if self._nobody_serving_since is None:
            self._nobody_serving_since = now
        return now - self._nobody_serving_since < NOBODY_SERVING_GRACE

    def _refresh_serving(self, now: float) -> None:
        """Keep the serving lock true when nothing has said for a while whether this relay
        reaches Kafka: batches in flight that Kafka does not answer mean it does not; an
        idle relay asks a broker."""
        assert self._ownership is not None and self._publisher is not None
        if not self.config.exactly_once:
            return  # its take-overs ask nothing of Kafka: it never steps aside
        if self._busy_shards:
            oldest = min(began for _, began, _ in self._busy_shards.values())
            if now - max(oldest, self._last_ack) > UNANSWERED_SECONDS:
                self._ownership.mark_failing()
            return
        if now - max(self._last_reached, self._probed_at) <= SERVING_REFRESH_SECONDS:
            return
        self._probed_at = now
        try:
            self._publisher.check_reachable(KAFKA_PROBE_TIMEOUT)
        except KafkaException:
            self._ownership.mark_failing()
            return
        self._last_reached = now
        if now - self._last_failed_take_over > RECENT_FAILURE_SECONDS:
            self._ownership.mark_serving()

    def _lost_database(self, error: Exception) -> None:
        log.error("database unreachable: %s", mask_secrets(str(error).splitlines()[0]))
        self.health.database_ok = False
        if self._publisher is not None and self._busy_shards:
            # The shards' locks went with the connection: another relay may take them over and
            # send the same rows. Stop sending what is still unacknowledged; the rows of the
            # batches in flight stay pending, to be read again by whoever owns them next.
            self._publisher.stop_sending()
            self._publisher.wait(0)
        self._recorder.abandon()  # no statement may run on the session when it is closed
        self._take_overs.ended(wait_for_all=True)  # their shards are let go below
        self._busy_shards.clear()
        self._rows.clear()
        self._quiet.forget()
        if self._ownership is not None:
            lost = self._ownership.forget()
            if lost and self._publisher is not None:
                self._publisher.let_go(lost)
        if self._wake is not None:
            self._wake.forget()
        for session in self._sessions():
            session.close()
        self._conn = self._reader = None
        self._markers = []
        self._free_markers = queue.SimpleQueue()
        self.metrics.owned_shards.set(0)

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
