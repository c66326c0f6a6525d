"""Carrying the core's commands out on the adapters, and feeding their answers back.

The driver knows no threads and no clock of its own: the relay's loop (:mod:`outbox.relay.daemon`)
calls :meth:`Driver.turn` and :meth:`Driver.handle` with ``time.monotonic()``, and runs slow
work (take-overs, probes) on the executor it hands in; the model-based test calls the same
methods with its simulated clock, adapters and executor. Reads, rebalances and the serving
lock are answered at once (they run on the caller's thread); sends, records, take-overs and
probes answer later, through ``post``.

It also keeps the relay's metrics and health up to date from what goes by, and logs what an
operator needs to see: messages made dead or retried (once recorded), shards lost.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from datetime import UTC, datetime
from typing import Protocol

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
)
from outbox.relay.core import RelayCore
from outbox.relay.observability import HealthState, RelayMetrics, mask_secrets
from outbox.relay.policy import RETRIABLE, classify
from outbox.relay.reach import EVIDENCE_SECONDS, STEP_ASIDE_SECONDS
from outbox.relay.sender import Sender
from outbox.relay.tracing import start_batch_span
from outbox.rows import PendingRow
from outbox.sending import Ack, order_gaps

log = logging.getLogger("outbox.relay")


class Source(Protocol):
    """Where the relay's messages come from (the table: :mod:`outbox.relay.table_source`)."""

    def read(self, read: Read, owned: Sequence[int]) -> list[PendingRow]: ...


class RecordsOutcomes(Protocol):
    def submit(self, recording: Recording) -> None: ...


class HoldsLeases(Protocol):
    def rebalance(self, command: Rebalance) -> Rebalanced: ...

    def release(self, shards: Sequence[int], hold_off: float = 0.0) -> None: ...

    def step_aside(self) -> tuple[int, ...] | None: ...

    def set_serving(self, serving: bool) -> None: ...


class Driver:
    """The core, its adapters, and what goes between them (see the module)."""

    def __init__(
        self,
        core: RelayCore,
        *,
        source: Source,
        sender: Sender,
        recorder: RecordsOutcomes,
        leases: HoldsLeases,
        background: Executor,
        post: Callable[[Event | BaseException], None],
        metrics: RelayMetrics,
        health: HealthState,
    ) -> None:
        self.core = core
        self.source = source
        self.sender = sender
        self.recorder = recorder
        self.leases = leases
        self.background = background
        self.post = post
        self.metrics = metrics
        self.health = health
        self.batches = 0
        #: When each take-over running began (the core's clock): one that never ends wedges.
        self.take_overs: dict[tuple[int, ...], float] = {}
        self._spans: dict[int, Callable[[], None]] = {}

    def turn(self, now: float) -> bool:
        """What fell due with time, then every read the core asks for now. Returns whether
        a read found rows."""
        self.execute(self.core.tick(now), now)
        found = False
        while (read := self.core.next_read(now)) is not None:
            owned = sorted(self.core.owned - self.core.taking_over)
            rows = self.source.read(read, owned)
            found = found or bool(rows)
            self.handle(RowsRead(read, rows), now)
            if not rows and not self.core.in_flight:
                self.health.batch_done(progressed=True)  # nothing to send is not being stuck
        return found

    def handle(self, event: Event, now: float) -> None:
        """An adapter's answer: seen (metrics, logs), then fed to the core."""
        self._observe(event, now)
        self.execute(self.core.handle(event, now), now)

    def execute(self, commands: Sequence[Command], now: float) -> None:
        for command in commands:
            if isinstance(command, Send):
                self._send(command.batch)
            elif isinstance(command, Record):
                self.recorder.submit(command.recording)
            elif isinstance(command, Read):
                owned = sorted(self.core.owned - self.core.taking_over)
                self.handle(RowsRead(command, self.source.read(command, owned)), now)
            elif isinstance(command, Rebalance):
                self.handle(self.leases.rebalance(command), now)
            elif isinstance(command, TakeOver):
                self._take_over(command.shards, now)
            elif isinstance(command, LetGo):
                self.sender.let_go(command.shards)
            elif isinstance(command, Release):
                self.leases.release(command.shards, command.hold_off)
                if command.hold_off:
                    log.warning(
                        "letting go of shards %s: their producer cannot go on", list(command.shards)
                    )
            elif isinstance(command, StepAside):
                self.handle(SteppedAside(self.leases.step_aside()), now)
            elif isinstance(command, Serving):
                self.leases.set_serving(command.serving)
            elif isinstance(command, Probe):
                self._probe()
            elif isinstance(command, StopSending):
                self.sender.stop_sending()
            self.metrics.owned_shards.set(len(self.core.owned))

    # -- the slow ones, off the caller's thread -------------------------------------------

    def _send(self, batch: Batch) -> None:
        # A trace span per batch, linked to its messages' contexts (with OpenTelemetry).
        self._spans[batch.number] = start_batch_span(batch.records)
        self.metrics.batch_size.observe(len(batch.rows))
        self.sender.start(batch)

    def _take_over(self, shards: tuple[int, ...], now: float) -> None:
        log.info("taking over shards %s", list(shards))
        self.take_overs[shards] = now

        def take_over() -> None:
            try:
                recovered = self.sender.take_over(shards)
            except Exception as error:  # Kafka, a timeout: the shards go back
                self.post(TakenOver(shards, error=mask_secrets(str(error))))
            else:
                self.post(TakenOver(shards, recovered))

        self.background.submit(take_over)

    def _probe(self) -> None:
        def probe() -> None:
            try:
                reached = self.sender.probe(EVIDENCE_SECONDS)
            except Exception:  # a probe that fails in any way did not reach
                log.exception("probing Kafka failed")
                reached = False
            self.post(Probed(reached))

        self.background.submit(probe)

    # -- what goes by ----------------------------------------------------------------------

    def _observe(self, event: Event, now: float) -> None:
        if isinstance(event, BatchEnded):
            self._ended(event.batch, event, now)
        elif isinstance(event, Recorded):
            self._recorded(event.recording, event.held)
        elif isinstance(event, TakenOver):
            began = self.take_overs.pop(event.shards, now)
            if event.error is None:
                marked = sum(len(acks) for acks in event.recovered.values())
                log.info(
                    "took over shards %s in %.2fs (%d messages found committed by their last "
                    "owner)",
                    list(event.shards),
                    now - began,
                    marked,
                )
            else:
                log.error("taking over shards %s failed: %s", list(event.shards), event.error)
        elif isinstance(event, Probed):
            self.health.kafka_ok = event.reached
            if not event.reached:
                log.warning(
                    "Kafka out of reach: a broker did not answer in %.0fs", EVIDENCE_SECONDS
                )
        elif isinstance(event, Rebalanced) and event.joined:
            self.health.stepped_aside = False
        elif isinstance(event, SteppedAside) and event.released is not None:
            self.health.stepped_aside = True  # not ready until it joins the members again
            self.health.batch_done(progressed=True)  # owning nothing, it is not stuck
            log.warning(
                "Kafka does not answer this relay: stepping aside (released shards %s) so that "
                "the other relays take them, for %.0fs at least",
                list(event.released),
                STEP_ASIDE_SECONDS,
            )

    def _ended(self, batch: Batch, event: BatchEnded, now: float) -> None:
        result = event.result
        end_span = self._spans.pop(batch.number, None)
        if end_span is not None:
            end_span()
        if batch.number not in self.core.in_flight:
            return  # forgotten
        self.batches += 1
        self.metrics.batch_seconds.observe(max(0.0, now - batch.started))
        self.health.batch_done(progressed=bool(result.acks or result.errors))
        if result.acks:
            self.health.kafka_ok = True
            self._count_published(batch, result.acks)
        elif result.batch_error is not None or result.lost_shards:
            self.metrics.batches_failed.inc()
            why = result.batch_error.str() if result.batch_error else "producer lost"
            log.warning("a batch of shards %s failed as a whole: %s", sorted(batch.shards), why)
        gaps = order_gaps(batch.records, result, lambda e: classify(e) == RETRIABLE)
        if gaps:
            self.metrics.order_gaps.inc(len(gaps))
            log.error(
                "%d messages were acknowledged after an earlier message of their key failed",
                len(gaps),
                extra={"message_ids": [str(g) for g in gaps]},
            )

    def _count_published(self, batch: Batch, acks: Sequence[Ack]) -> None:
        """Count what a batch sent and how long each message waited (one pass: it runs for
        every message)."""
        acked_at = datetime.now(UTC)
        rows = {row.id.int: row for row in batch.rows}
        observe = self.metrics.commit_to_ack.observe
        topics: list[str] = []
        for ack in acks:
            row = rows.get(ack.id.int)
            if row is not None and row.record is not None:
                topics.append(row.record.topic)
                observe((acked_at - row.created_at).total_seconds())
        for topic, count in Counter(topics).items():
            self.metrics.published.labels(topic).inc(count)

    def _recorded(self, recording: Recording, held: frozenset[object]) -> None:
        if recording.number not in self.core.recordings:
            return  # forgotten
        topics = {}
        if recording.batch is not None:
            topics = {row.id: row.record.topic for row in recording.batch.rows if row.record}
        for failure in recording.failures:
            if failure.id in held:
                continue
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
