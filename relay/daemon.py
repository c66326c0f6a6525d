"""The relay: its loop, its threads, its sessions, and its shutdown.

The relay is a core that decides (:mod:`outbox.relay.core`) and adapters that do the I/O,
wired by :mod:`outbox.relay.driver`:

- the source (:mod:`outbox.relay.table_source`): the reading session; reads, due scheduled
  rows, the wake-up handshake with the writers;
- the sender (:mod:`outbox.relay.sender`, :mod:`outbox.relay.transactions`): the producers,
  served by a thread of their own;
- the recorder (:mod:`outbox.relay.recorder`): marks and failures, on marking sessions of its
  own, in the background;
- the leases (:mod:`outbox.relay.leases`): the owner session and its advisory locks.

Each turn of the loop gives the core the time (what fell due: a rebalance, a record to try
again), makes the reads it asks for, takes in what the adapters answered meanwhile, and then
waits: for an answer while anything is in flight, being recorded or taken over; on the
source's wake-up (a writer's commit, the poll interval) when there is nothing to do.

SIGTERM or SIGINT: the relay stops reading, lets what is in flight end and be recorded (half
of ``shutdown_timeout`` at most, then what Kafka has not acknowledged is given back), releases
its shards and exits 0. A lost session (any of them) lets go of everything: what is in flight
is forgotten (its rows stay pending for the shards' next owner), the sessions close, and the
relay connects again.
"""

from __future__ import annotations

import gc
import logging
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

import psycopg
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from sqlalchemy import exc as sa_exc

from outbox.engines import sender_engine
from outbox.relay.commands import BatchEnded, Event, Woken
from outbox.relay.config import RelayConfig, masked_kafka_config
from outbox.relay.connections import open_session
from outbox.relay.core import RelayCore
from outbox.relay.driver import Driver
from outbox.relay.leases import Leases
from outbox.relay.observability import HealthState, RelayMetrics, mask_secrets, serve
from outbox.relay.progress import ensure_progress_topic
from outbox.relay.reach import EVIDENCE_SECONDS, FIRST_PAUSE
from outbox.relay.recorder import Recorder
from outbox.relay.sender import KAFKA_LOG, AtLeastOnceSender, Sender
from outbox.relay.store import RelayStore
from outbox.relay.table_source import TableSource
from outbox.relay.transactions import TRANSACTION_MARGIN_MS, ExactlyOnceSender

log = logging.getLogger("outbox.relay")

#: Garbage collector thresholds of the relay process (see tune_garbage_collector).
GC_THRESHOLDS = (50_000, 20, 100)


def tune_garbage_collector() -> None:
    """Collect cycles less often than Python's default (every 700 new objects).

    A batch makes thousands of objects that live until its outcome is recorded, so the
    default thresholds run full collections over every live object many times a second:
    measured, a third of the loop's time with exactly-once batches. The relay makes few
    cycles; the objects that exist when this is called (the modules loaded) are frozen out of
    the scans.

    Process-wide: ``outbox relay`` calls it; an application that embeds a relay decides.
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class EventQueue(Protocol):
    """Where the adapters' answers wait for the loop (a ``queue.SimpleQueue``)."""

    def put(self, item: Event | BaseException) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Event | BaseException: ...

    def get_nowait(self) -> Event | BaseException: ...


class Waits(Protocol):
    """The stop flag the loop waits on between tries (a ``threading.Event``)."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass
class Parts:
    """What a relay is made of besides its core and driver: its adapters, the executor of
    its slow work, where answers queue, its clock and its stop flag. :meth:`Relay` makes the
    real ones; the model-based test makes simulated ones (and drives :meth:`Relay.step`)."""

    source: TableSource
    leases: Leases
    recorder: Recorder
    make_sender: Callable[[Relay], Sender]
    background: Executor
    events: EventQueue
    clock: Callable[[], float] = time.monotonic
    stop: Waits = field(default_factory=threading.Event)
    #: Whether the sender gets a thread of its own to serve it (the simulation serves it).
    serving_thread: bool = True


class Relay:
    """One relay instance. ``run()`` blocks until :meth:`stop` (or a signal) and returns 0
    (1: Kafka's client refused its settings)."""

    def __init__(
        self,
        config: RelayConfig,
        metrics: RelayMetrics | None = None,
        *,
        parts: Callable[[Relay], Parts] | None = None,
    ) -> None:
        self.config = config
        self.owner = f"relay-{uuid.uuid4()}"
        self.metrics = metrics or RelayMetrics()
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
        self.core = RelayCore(
            exactly_once=config.exactly_once,
            batch_size=config.batch_size,
            retry=config.retry,
            rebalance_interval=config.rebalance_interval,
        )
        made = (parts or _real_parts)(self)
        self.source, self.leases, self.recorder = made.source, made.leases, made.recorder
        self._make_sender = made.make_sender
        self._background = made.background
        self._events = made.events
        self._clock = made.clock
        self._stop = made.stop
        self._serve_in_thread = made.serving_thread
        self.sender: Sender | None = None
        self.driver: Driver | None = None
        self._stop_requested_at = 0.0
        self._serving_thread: threading.Thread | None = None
        self.metrics_server_port: int | None = None

    # -- what tests and operators see ------------------------------------------------------

    @property
    def owned_shards(self) -> frozenset[int]:
        """The shards this relay owns now."""
        return frozenset(self.core.owned)

    @property
    def asleep(self) -> bool:
        """Whether the relay sleeps, watching for commits (writers notify it)."""
        return self.source.asleep

    @property
    def batches(self) -> int:
        """Batches sent and answered so far."""
        return self.driver.batches if self.driver is not None else 0

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to finish what is in flight and exit."""
        if not self._stop.is_set():
            self._stop_requested_at = self._clock()
        self._stop.set()
        self.health.stopping = True

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
        try:
            while not self._finished() and self.exit_code is None:
                self.step()
        finally:
            self.shutdown()
            if server is not None:
                server.shutdown()
        return self.exit_code or 0

    #: Set when the relay must exit without being asked (1: Kafka refused its settings).
    exit_code: int | None = None
    _pause = FIRST_PAUSE

    def step(self) -> None:
        """One round of the loop: connect if need be, then one turn; a lost database or an
        unreachable Kafka is let go of and tried again after a pause (doubling, at most
        EVIDENCE_SECONDS)."""
        try:
            self._connect()
            self._turn()
            self._pause = FIRST_PAUSE
        except (psycopg.Error, sa_exc.DBAPIError, sa_exc.InterfaceError) as error:
            # Any database error, not only a lost connection: a server that refuses writes
            # (a demoted primary), a grant revoked. The relay lets its shards go and tries
            # again; a server that takes its statements again finds it back.
            self._lost_database(error)
            self._stop.wait(self._pause)
            self._pause = min(EVIDENCE_SECONDS, self._pause * 2)
        except (KafkaException, TimeoutError) as error:
            self.health.kafka_ok = False
            if (
                isinstance(error, KafkaException)
                and error.args[0].code() == KafkaError._INVALID_ARG
            ):
                # A setting Kafka's client refuses: no retry will change it.
                log.critical("Kafka client settings refused: %s", error.args[0].str())
                self.exit_code = 1
                return
            log.error("Kafka error: %s; retrying in %.1fs", mask_secrets(str(error)), self._pause)
            self._stop.wait(self._pause)
            self._pause = min(EVIDENCE_SECONDS, self._pause * 2)

    # -- the loop --------------------------------------------------------------------------

    def _turn(self) -> None:
        """One turn: the core's due work and reads, what the adapters answered, the wait."""
        driver = self.driver
        assert driver is not None
        now = self._clock()
        if self._stop.is_set():
            self.core.stop()
        found = driver.turn(now)
        self._take_events(timeout=None)
        self.health.tick()
        self.health.working_since(self._oldest_unfinished(), self._oldest_mark_or_take_over())
        if self._finished():
            return
        now = self._clock()
        until, idle = self.core.wait_until(now)
        timeout = max(0.0, min(until - now, self.config.poll_interval))
        if found or not idle:
            self.source.busy()
            if not found:
                self._take_events(timeout)
        elif not self.core.owned or not self.core.joined:
            # Owning no shard, it must not watch for the others: writers would notify at
            # every commit while they work.
            self.source.away()
            self._take_events(timeout)
        elif self.source.sleep(timeout):
            driver.handle(Woken(), self._clock())

    def _take_events(self, timeout: float | None) -> None:
        """Hand the adapters' answers to the driver: those queued now, or (``timeout``) the
        first one to come within that long and those queued after it."""
        assert self.driver is not None
        try:
            item = self._events.get(timeout=timeout) if timeout else self._events.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, BaseException):
                raise item  # a session broke under a statement run in the background
            self.driver.handle(item, self._clock())
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                return

    def _finished(self) -> bool:
        """Stopping, and what is in flight ended and was recorded (or the shutdown's time for
        it is up)."""
        if not self._stop.is_set():
            return False
        waited = self._clock() - self._stop_requested_at
        if self.driver is None or self.core.idle:
            return True
        if waited > self.config.shutdown_timeout / 2 and not self.core.in_flight:
            return True  # records held by row locks: their rows stay pending for the next owner
        return waited > self.config.shutdown_timeout

    def _shutdown_overdue(self) -> bool:
        """A stop was asked for and the batches in flight had their share of the shutdown
        time: what Kafka has not acknowledged is given back."""
        return (
            self._stop.is_set()
            and self._clock() - self._stop_requested_at > self.config.shutdown_timeout / 2
        )

    def _oldest_unfinished(self) -> float | None:
        """When the oldest batch in flight, record or take-over began: one that never ends
        wedges its shards while the others go on."""
        began = [
            self.core.waiting_since(),
            self.core.oldest_recording(),
            *(self.driver.take_overs.values() if self.driver else ()),
        ]
        return min((b for b in began if b is not None), default=None)

    def _oldest_mark_or_take_over(self) -> float | None:
        began = [
            self.core.oldest_recording(),
            *(self.driver.take_overs.values() if self.driver else ()),
        ]
        return min((b for b in began if b is not None), default=None)

    # -- sessions --------------------------------------------------------------------------

    def _connect(self) -> None:
        # Kafka first: a sender that could not be made (broker unreachable) is retried on the
        # next round even when the database connection is already up.
        if self.sender is None:
            self.sender = self._make_sender(self)
            self.driver = Driver(
                self.core,
                source=self.source,
                sender=self.sender,
                recorder=self.recorder,
                leases=self.leases,
                background=self._background,
                post=self._events.put,
                metrics=self.metrics,
                health=self.health,
            )
            if self._serve_in_thread:
                self._serving_thread = threading.Thread(
                    target=self._serve_sender, name="outbox-kafka", daemon=True
                )
                self._serving_thread.start()
        if self.leases.connected and self.source.connected and self.recorder.connected:
            return
        if self._connected:
            # Broken under a statement whose error the loop has not seen yet: what the old
            # sessions held is let go of first.
            self._lost_database(psycopg.OperationalError("a relay session was closed"))
        try:
            key = self.leases.connect()
            self.source.connect(key, self.owner)
            self.recorder.connect(key, self.owner)
        except BaseException:
            self.recorder.forget()
            self.source.forget()
            self.leases.forget()
            raise
        self._connected = True
        self.health.database_ok = True
        log.info("connected; listening on %s", self.config.spec.notify_channel)

    def _serve_sender(self) -> None:
        """The sender's own thread: serve its client, hand ended batches to the loop."""
        while not self._closing:
            try:
                self.serve_sender(0.2)
            except Exception:  # never let the reports stop: the loop would wait for ever
                log.exception("serving the Kafka client failed")
                time.sleep(0.2)

    def serve_sender(self, timeout: float) -> None:
        """Serve the sender up to ``timeout``; queue the batches that ended for the loop."""
        assert self.sender is not None
        for batch, result in self.sender.serve(timeout):
            self._events.put(BatchEnded(batch, result))

    _closing = False

    def make_kafka_sender(self) -> Sender:
        """The real sender for this relay's mode."""
        if not self.config.exactly_once:
            return AtLeastOnceSender(
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
        return ExactlyOnceSender(
            self.config.kafka,
            transactional_id_prefix=self.config.transactional_prefix,
            progress_topic=self.config.progress_topic_name,
            owner=self.owner,
            delivery_timeout_ms=self.config.delivery_timeout_ms,
            give_up=self._shutdown_overdue,
        )

    _connected = False

    def _lost_database(self, error: Exception) -> None:
        log.error(
            "database unreachable or refusing the relay (%s): %s",
            type(error).__name__,
            mask_secrets((str(error).splitlines() or [""])[0]),
        )
        self._connected = False
        self.health.database_ok = False
        if self.driver is not None:
            # The shards' locks went with the connection: another relay may take them over
            # and send the same rows. What is in flight is stopped and forgotten; its rows
            # stay pending, read again by whoever owns the shards next.
            self.driver.execute(self.core.lost_database(), self._clock())
        self.recorder.forget()  # no statement may run on a session when it is closed
        self.source.forget()
        self.leases.forget()
        self.metrics.owned_shards.set(0)

    def shutdown(self) -> None:
        """Release the shards, close everything (the end of :meth:`run`)."""
        released: list[int] = []
        self.recorder.abandon()  # before the shards are let go
        try:
            if self.leases.connected:
                released = self.leases.release_all()
                self.source.away()  # an idle relay in this one's care takes the watch
        except psycopg.Error:
            pass  # the locks go with the connection anyway
        self._closing = True
        if self._serving_thread is not None:
            self._serving_thread.join(5)
        self._background.shutdown(wait=True, cancel_futures=True)
        self.recorder.close()
        if self.sender is not None:
            self.sender.close()
        self.source.close()
        self.leases.forget()
        log.info(
            "relay %s stopped after %d batches; released shards %s",
            self.owner,
            self.batches,
            released,
        )


def _real_parts(relay: Relay) -> Parts:
    config = relay.config
    # The store's engines open no connection unless a test or the CLI asks them to.
    store = RelayStore(
        sender_engine(config.database_url, durable=False),
        config.spec,
        relay.owner,
        config.delete_on_send,
    )
    events: queue.SimpleQueue[Event | BaseException] = queue.SimpleQueue()
    return Parts(
        source=TableSource(config, store, relay.metrics),
        leases=Leases(config.spec, lambda: open_session(config, relay.owner)),
        recorder=Recorder(config, store, relay.metrics, events.put),
        make_sender=Relay.make_kafka_sender,
        background=ThreadPoolExecutor(max_workers=4, thread_name_prefix="outbox-relay"),
        events=events,
    )
