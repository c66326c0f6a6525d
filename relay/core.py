"""The relay's core: what it owns, has read, has in flight and is recording, and what to do next.

The core decides and does no I/O (as h11 keeps HTTP/1.1 free of it). Fed events (rows read, a
batch answered, an outcome recorded, shards gained, a probe's answer) and the clock, it
answers with commands (read these shards, send this batch, record that outcome, let these
shards go), which the driver (:mod:`outbox.relay.driver`) carries out on the adapters. The
model-based test runs this same core on a simulated clock, database and broker.

What it keeps:

- **One batch of a shard at a time.** A shard is read only when it is owned, taken over, and
  has no batch in flight or being recorded; it stays busy until the batch's outcome is
  recorded (a row another transaction holds locked keeps its own shard busy until it is). So
  one relay never sends a row twice, and a key's messages go in order, also across retries.
- **Shards change hands idle.** A rebalance lets go only of idle shards; shards above the
  share that are busy are read no more and go at a later rebalance. Losing the database or
  stepping aside forgets what is in flight: at-least-once it is stopped (sent again by the
  next owner), exactly-once the next owner fences it.
- **A refusal judged alone.** A message the broker refused for its size or content together
  with others (the whole request is refused) is a *suspect*: it is sent again alone, and only
  a refusal of it alone makes it dead. Its key's later messages wait behind it.
- **Kafka's failures are not the messages'.** :mod:`outbox.relay.reach`.
- **Bounded batches.** A batch holds at most :data:`~outbox.relay.reading.BATCH_BYTES` of
  records, an exactly-once transaction at most :data:`~outbox.relay.progress.PROGRESS_ACKS`
  messages (its progress record lists them all, and a record has a size limit).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable, Sequence

from confluent_kafka import KafkaError

from outbox.relay.commands import (
    Batch,
    BatchEnded,
    Command,
    Event,
    LetGo,
    Probe,
    Probed,
    Read,
    Rebalance,
    Rebalanced,
    Record,
    Recorded,
    Recording,
    Release,
    RowsRead,
    Send,
    Serving,
    StepAside,
    SteppedAside,
    StopSending,
    TakenOver,
    TakeOver,
    Woken,
)
from outbox.relay.policy import (
    ATTEMPTS_EXHAUSTED,
    REFUSED_WITH_OTHERS,
    RETRIABLE,
    RetryPolicy,
    classify,
)
from outbox.relay.progress import PROGRESS_ACKS
from outbox.relay.reach import EVIDENCE_SECONDS, FIRST_PAUSE, KafkaReach
from outbox.relay.reading import BATCH_BYTES, ReadPlanner, within_bytes
from outbox.rows import UNDECODABLE, Failure, PendingRow
from outbox.sending import Ack


class RelayCore:
    """The deciding part of one relay (see the module's rules). Every method takes the
    time now (``time.monotonic()`` in the relay, the simulation's clock in its test)."""

    def __init__(
        self,
        *,
        exactly_once: bool,
        batch_size: int,
        retry: RetryPolicy,
        rebalance_interval: float,
    ) -> None:
        self.exactly_once = exactly_once
        self.retry = retry
        self.rebalance_interval = rebalance_interval
        self.reads = ReadPlanner(batch_size, exactly_once)
        self.reach = KafkaReach()
        self.owned: set[int] = set()
        self.joined = False
        self.taking_over: set[int] = set()
        #: Owned shards above the share, busy when the rebalance wanted them: read no more.
        self.leaving: set[int] = set()
        self.in_flight: dict[int, Batch] = {}
        self.recordings: dict[int, Recording] = {}
        #: Recordings waiting for another transaction's row lock: when to try again.
        self.retry_at: dict[int, float] = {}
        #: Which batch or recording (by number) holds each busy shard.
        self.busy: dict[int, int] = {}
        #: Messages refused together with others: sent alone next (id -> shard).
        self.suspects: dict[uuid.UUID, int] = {}
        #: Exactly-once shards whose transaction failed whole: fewer rows until one commits.
        self.caps: dict[int, int] = {}
        self.stopping = False
        self.next_rebalance = 0.0
        self._step_aside_tried = float("-inf")
        self._serving = False
        #: Members other than this relay, and those of them serving, at the last rebalance.
        self._others = (0, 0)
        self._numbers = itertools.count(1)

    # -- what the loop asks ------------------------------------------------------------------

    def tick(self, now: float) -> list[Command]:
        """What falls due with time: records to try again, a rebalance, a probe, stepping
        aside, the serving lock."""
        commands: list[Command] = []
        for number, due in list(self.retry_at.items()):
            if due <= now:
                del self.retry_at[number]
                commands.append(Record(self.recordings[number]))
        waiting = self.waiting_since()
        if self.reach.should_probe(now, waiting) and not self.stopping:
            self.reach.probing = True
            commands.append(Probe())
        if now >= self.next_rebalance and not self.stopping:
            self.next_rebalance = now + self.rebalance_interval
            commands.append(self._rebalance(now, waiting))
        if (
            self.joined
            and not self.stopping
            and not self.recordings
            and self.reach.should_step_aside(now, waiting)
            and now - self._step_aside_tried >= self.rebalance_interval
        ):
            self._step_aside_tried = now
            commands.append(StepAside())
        serving = self.joined and self.reach.serving(
            now, waiting, owns_shards=bool(self.owned - self.taking_over)
        )
        if serving != self._serving:
            self._serving = serving
            commands.append(Serving(serving))
        return commands

    def next_read(self, now: float) -> Read | None:
        """The next read to make now, or None."""
        if self.stopping or not self.reach.may_send(now):
            return None
        idle = [
            shard
            for shard in sorted(self.owned)
            if shard not in self.busy and shard not in self.taking_over
        ]
        suspected = set(self.suspects.values())
        if suspected and not self.exactly_once:
            # At-least-once the shards share a producer, which packs records of a partition
            # into one request whatever their batch: a suspect goes only with nothing else in
            # flight, and nothing else goes meanwhile.
            if self.in_flight:
                return None
            due = self.reads.due([shard for shard in idle if shard in suspected], now)
            if due:
                _, per_shard = self.reads.limits(1, 1)
                return Read((due[0],), per_shard, per_shard)
            return None
        readable = [shard for shard in idle if shard not in self.leaving]
        return self.reads.plan(readable, len(self.owned), now)

    def wait_until(self, now: float) -> tuple[float, bool]:
        """Until when the loop may wait for an event, and whether it may sleep (nothing is
        running, so nothing but a commit or the clock brings work)."""
        due = [self.next_rebalance, *self.retry_at.values()]
        relook = self.reads.relook_at()
        if relook is not None and (self.in_flight or self.recordings or self.taking_over):
            due.append(relook)
        if self.reach.paused_until > now:
            due.append(self.reach.paused_until)
        idle = not (self.in_flight or self.recordings or self.taking_over)
        return min(due), idle

    def waiting_since(self) -> float | None:
        """When the oldest batch in flight was sent (None: none is)."""
        return min((batch.started for batch in self.in_flight.values()), default=None)

    def oldest_recording(self) -> float | None:
        return min((r.began for r in self.recordings.values()), default=None)

    @property
    def idle(self) -> bool:
        return not (self.in_flight or self.recordings or self.taking_over)

    def stop(self) -> None:
        """Read nothing more, take nothing more; what is in flight ends and is recorded."""
        self.stopping = True

    def lost_database(self) -> list[Command]:
        """The sessions are gone, and every lock with them: forget everything."""
        commands: list[Command] = []
        if self.in_flight:
            commands.append(StopSending())
        lost = sorted(self.owned)
        if lost and self.exactly_once:
            commands.append(LetGo(tuple(lost)))
        self._forget_all()
        self.joined = False
        self._serving = False
        return commands

    # -- events ------------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Command]:
        """Take in what an adapter reports; return what to do about it."""
        if isinstance(event, RowsRead):
            return self._rows_read(event.read, event.rows, now)
        if isinstance(event, BatchEnded):
            return self._batch_ended(event, now)
        if isinstance(event, Recorded):
            return self._recorded(event.recording, event.held, now)
        if isinstance(event, TakenOver):
            return self._taken_over(event, now)
        if isinstance(event, Rebalanced):
            return self._rebalanced(event, now)
        if isinstance(event, SteppedAside):
            return self._stepped_aside(event.released, now)
        if isinstance(event, Probed):
            self.reach.probed(event.reached, now, idle=self.idle and self.reach.may_send(now))
            if event.reached and not self.stopping:
                self.next_rebalance = now  # fresh evidence: join and take shards with it now
        elif isinstance(event, Woken):
            self.reads.woken()
        return []

    def _rows_read(self, read: Read, rows: Sequence[PendingRow], now: float) -> list[Command]:
        self.reads.read(read, rows, now)
        by_shard: dict[int, list[PendingRow]] = {shard: [] for shard in read.shards}
        for row in rows:  # in seq order
            if row.shard in by_shard:
                by_shard[row.shard].append(row)
        going: list[list[PendingRow]] = []
        alone: list[PendingRow] = []
        for shard, shard_rows in by_shard.items():
            if shard not in self.owned or shard in self.busy:
                continue
            take, suspect = self._cut(shard, shard_rows, full=len(shard_rows) >= read.per_shard)
            if suspect is not None:
                alone.append(suspect)
            elif take:
                going.append(take)
        if not self.exactly_once and going:
            # One flight of every shard's rows, in the read's order (seq): each shard's rows
            # stay a prefix of what was read, however many bytes are left out.
            kept = {row.id.int for part in going for row in part}
            going = [[row for row in rows if row.id.int in kept]]
        commands: list[Command] = []
        for part, isolated in [*((p, False) for p in going), *(([r], True) for r in alone)]:
            commands.extend(self._start(within_bytes(part, BATCH_BYTES), now, isolated))
        # A shard read that sends nothing now is looked at again later, not at once.
        self.reads.looked(read, rows, self.busy.keys(), now)
        return commands

    def _cut(
        self, shard: int, rows: list[PendingRow], full: bool
    ) -> tuple[list[PendingRow], PendingRow | None]:
        """What of a shard's rows goes now: those before its first suspect, or that suspect
        alone when it comes first; exactly-once at most a transaction's worth."""
        mine = {suspect for suspect, of in self.suspects.items() if of == shard}
        if mine and not full:
            # Every pending row of the shard was read: a suspect not among them is gone
            # (made dead or purged by an operator, say).
            for gone in mine - {row.id for row in rows}:
                del self.suspects[gone]
        for position, row in enumerate(rows):
            if row.id in self.suspects:
                if position == 0:
                    return [], row
                rows = rows[:position]
                break
        if self.exactly_once:
            rows = rows[: self.caps.get(shard, PROGRESS_ACKS)]
        return rows, None

    def _start(self, rows: list[PendingRow], now: float, isolated: bool) -> list[Command]:
        failures = [
            Failure(row.id, UNDECODABLE, row.problem or UNDECODABLE, None)
            for row in rows
            if row.record is None
        ]
        batch = Batch(
            next(self._numbers),
            rows,
            frozenset(row.shard for row in rows),
            now,
            isolated=isolated,
            failures=failures,
        )
        if not batch.records:  # nothing to send: record the failures at once
            return self._record(set(batch.shards), [], failures, _shards_of(batch), batch, now)
        for shard in batch.shards:
            self.busy[shard] = batch.number
        self.in_flight[batch.number] = batch
        return [Send(batch)]

    def _batch_ended(self, event: BatchEnded, now: float) -> list[Command]:
        batch, result = event.batch, event.result
        if self.in_flight.pop(batch.number, None) is None:
            return []  # forgotten: the database or the shards were lost meanwhile
        commands: list[Command] = []
        rows = {row.id: row for row in batch.rows}
        # Kafka takes the batches sent after this one: a failure is the message's own (a
        # partition of its stalled, say). Else it is an outage: nothing is charged.
        evidence = self.reach.answered_since(batch.started, now)
        lost = set(result.lost_shards) & self.owned
        # A lost shard's late delivery reports are no acks: its next owner's take-over says.
        acks = [ack for ack in result.acks if ack.id in rows and rows[ack.id].shard not in lost]
        if acks:
            self.reach.reached(now, sent=batch.started)
        failures = [f for f in batch.failures if rows[f.id].shard not in lost]
        unanswered = False
        for record_id, error in result.errors.items():
            row = rows.get(record_id)
            if row is None or row.shard in lost:
                continue
            kind = classify(error)
            if kind in REFUSED_WITH_OTHERS and not (
                batch.isolated or record_id in result.refused_alone
            ):
                self.suspects[record_id] = row.shard  # not charged: sent alone next
            elif kind == RETRIABLE:
                if evidence:
                    failures.append(self._retry(row, error))
                else:
                    unanswered = True
            else:
                failures.append(Failure(row.id, kind, error.str(), None))
        for done in [*(ack.id for ack in acks), *(f.id for f in failures)]:
            self.suspects.pop(done, None)
        if result.batch_error is not None and classify(result.batch_error) != RETRIABLE:
            if len(batch.rows) <= len(batch.shards):  # refused at one message a shard
                self.reach.failed(now, probe_clears=True)
            self._halve(batch)
        elif acks:
            for shard in batch.shards:
                self.caps.pop(shard, None)
        whole = result.batch_error
        if unanswered or (whole is not None and classify(whole) == RETRIABLE and not acks):
            self.reach.failed(now, probe_clears=True)
        if lost:
            self.owned -= lost
            self.reads.forget(lost)
            self._free(lost)
            for suspect, shard in list(self.suspects.items()):
                if shard in lost:
                    del self.suspects[suspect]
            commands.append(LetGo(tuple(sorted(lost))))
            # Its take-over may block while Kafka is unwell; another relay may serve it.
            commands.append(Release(tuple(sorted(lost)), EVIDENCE_SECONDS))
        holds = {shard for shard in batch.shards if self.busy.get(shard) == batch.number}
        recording = self._record(holds, acks, failures, _shards_of(batch), batch, now)
        return commands + recording

    def _halve(self, batch: Batch) -> None:
        """The transaction was refused as a whole (its progress record, say): fewer rows per
        transaction until one commits; refused at one, the relay pauses as after an outage."""
        for shard in batch.shards:
            self.caps[shard] = max(1, len(batch.rows) // 2)

    def _retry(self, row: PendingRow, error: KafkaError) -> Failure:
        if self.retry.gives_up(row.attempts):
            return Failure(row.id, ATTEMPTS_EXHAUSTED, error.str(), None)
        return Failure(row.id, RETRIABLE, error.str(), self.retry.delay(row.attempts))

    def _record(
        self,
        holds: set[int],
        acks: list[Ack],
        failures: list[Failure],
        shard_of: dict[uuid.UUID, int],
        batch: Batch | None,
        now: float,
    ) -> list[Command]:
        """Record what became of a batch (or of a take-over's recovered rows); the shards
        it ``holds`` stay busy until it is recorded."""
        if not acks and not failures:
            self._free(holds)
            return []
        recording = Recording(next(self._numbers), acks, failures, shard_of, now, batch)
        for shard in holds:
            self.busy[shard] = recording.number
        self.recordings[recording.number] = recording
        return [Record(recording)]

    def _recorded(
        self, recording: Recording, held: frozenset[uuid.UUID], now: float
    ) -> list[Command]:
        current = self.recordings.get(recording.number)
        if current is None:
            return []  # forgotten meanwhile
        holding = {shard for row_id, shard in current.shard_of.items() if row_id in held}
        if holding:
            self.recordings[current.number] = Recording(
                current.number,
                [ack for ack in current.acks if ack.id in held],
                [failure for failure in current.failures if failure.id in held],
                {row_id: s for row_id, s in current.shard_of.items() if row_id in held},
                current.began,
                current.batch,
            )
            self.retry_at[current.number] = now + FIRST_PAUSE  # a try waits for no lock
        else:
            del self.recordings[current.number]
        self._free({s for s, number in self.busy.items() if number == current.number} - holding)
        self.reads.woken()  # no commit wakes a busy relay: rows may have come meanwhile
        return []

    def _free(self, shards: Iterable[int]) -> None:
        for shard in list(shards):
            self.busy.pop(shard, None)

    # -- shards changing hands ---------------------------------------------------------------

    def _rebalance(self, now: float, waiting: float | None) -> Rebalance:
        fresh = self.reach.fresh(now, waiting) and self.reach.may_send(now)
        join = not self.joined and fresh and self.reach.may_rejoin(now, *self._others)
        releasable = tuple(
            sorted(s for s in self.owned if s not in self.busy and s not in self.taking_over)
        )
        return Rebalance(releasable, may_gain=fresh and (self.joined or join), join=join)

    def _rebalanced(self, event: Rebalanced, now: float) -> list[Command]:
        commands: list[Command] = []
        self.joined = event.joined
        self._others = (event.other_members, event.others_serving)
        lost = set(event.lost) & self.owned
        self.owned -= lost
        self.reads.forget(lost)
        for suspect, shard in list(self.suspects.items()):
            if shard in lost:
                del self.suspects[suspect]
        if lost and self.exactly_once:
            commands.append(LetGo(tuple(sorted(lost))))
        gained = tuple(sorted(set(event.gained) - self.owned))
        self.owned.update(gained)
        self.taking_over.update(gained)
        if gained:
            commands.append(TakeOver(gained))
        busy = sorted((shard for shard in self.owned if shard in self.busy), reverse=True)
        self.leaving = set(busy[: event.surplus])
        return commands

    def _taken_over(self, event: TakenOver, now: float) -> list[Command]:
        shards = set(event.shards) & self.taking_over
        self.taking_over -= shards
        if not shards:
            return []  # forgotten meanwhile
        if event.error is not None:
            self.owned -= shards
            self.reads.forget(shards)
            self.reach.failed(now, probe_clears=False)
            return [LetGo(tuple(sorted(shards))), Release(tuple(sorted(shards)))]
        if self.exactly_once:
            self.reach.reached(now)  # the coordinator fenced the last owner: Kafka answers
        shard_of = {ack.id: shard for shard in shards for ack in event.recovered.get(shard, ())}
        acks = [ack for shard in sorted(shards) for ack in event.recovered.get(shard, ())]
        return self._record(set(shard_of.values()), acks, [], shard_of, None, now)

    def _stepped_aside(self, released: tuple[int, ...] | None, now: float) -> list[Command]:
        if released is None:
            return []  # nobody else serves: it stays and keeps trying
        commands: list[Command] = []
        if self.in_flight:
            commands.append(StopSending())
        had = tuple(sorted(self.owned))
        if had and self.exactly_once:
            commands.append(LetGo(had))
        self._forget_all()
        self.joined = False
        self._serving = False
        self.reach.stepped_aside(now)
        return commands

    def _forget_all(self) -> None:
        self.reads.forget(self.owned)
        self.owned.clear()
        self.taking_over.clear()
        self.leaving.clear()
        self.in_flight.clear()
        self.recordings.clear()
        self.retry_at.clear()
        self.busy.clear()
        self.suspects.clear()
        self.caps.clear()


def _shards_of(batch: Batch) -> dict[uuid.UUID, int]:
    return {row.id: row.shard for row in batch.rows}
