"""The relay loop: read the next rows of idle shards, start sending them, record what ended.

The loop keeps Kafka and PostgreSQL busy at once: while one batch is on its way to Kafka, the
outcome of the last one is recorded and the next one read. A shard has at most one batch in
flight, and its next rows are read only after that batch's outcome is recorded: so nothing is
sent twice by one relay, and a key's messages go in order, also across retries.

Each mechanism of the loop lives in a module of its own, whose docstring states the invariant
it keeps and what it assumes of the others; :class:`Relay` is made of them:

- :mod:`outbox.relay.reading`: read the next rows of idle shards and start them on their way;
- :mod:`outbox.relay.marking`: record what Kafka answered, in the background, and free the
  batch's shards;
- :mod:`outbox.relay.sleeping`: when an idle relay sleeps, and whether it watches for writers;
- :mod:`outbox.relay.rebalancing`: join, let shards go (drained first), take gained ones over;
- :mod:`outbox.relay.serving`: whether the relay reaches Kafka, and stepping aside;
- :mod:`outbox.relay.sessions`: the owner, reading and marking sessions, and what a lost one
  lets go;
- :mod:`outbox.relay.state`: the state they share, and the steps each asks of the others.

This module holds the loop itself (:meth:`Relay.run` and one :meth:`Relay._step` per turn),
and the shutdown: it stops reading (SIGTERM/SIGINT), lets the batches in flight finish and be
recorded, releases the shards and exits 0.
"""

from __future__ import annotations

import gc
import logging
import signal
import time
from types import FrameType

import psycopg
from confluent_kafka import KafkaError, KafkaException
from sqlalchemy import exc as sa_exc

from outbox.relay.config import masked_kafka_config
from outbox.relay.marking import (
    LOST_SHARD_HOLD_OFF,
    MARK_RETRY_SECONDS,
    WAIT_SLICE,
    OutcomeMarking,
)
from outbox.relay.observability import mask_secrets, serve
from outbox.relay.reading import EXACTLY_ONCE_READ_GROUPS, READ_GROUPS, BatchReading
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
from outbox.relay.state import MARKERS

#: The tunables of the loop, importable from here as they always were (each is defined in the
#: module of the mechanism it tunes: patch it there).
__all__ = [
    "EXACTLY_ONCE_READ_GROUPS",
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
#: The wait for an outcome being recorded while batches are in flight: Kafka's reports
#: are served at least this often meanwhile.
RECORDING_POLL = 0.002
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


class Relay(RelaySessions, BatchReading, OutcomeMarking, Rebalancing, Serving, Sleeping):
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
