"""The state the relay's mechanisms share, and the steps each one asks of the others.

:class:`~outbox.relay.daemon.Relay` is made of one class per mechanism (reading, marking,
sleeping, rebalancing, serving, sessions), each in a module of its own; they all work on the
state set up here, and call each other only through the steps declared at the end of
:class:`RelayState` (each is defined, and documented, by the mechanism named beside it).

Invariant: the state is the loop's. It is changed on the loop's thread only, but for what
other threads are handed explicitly: the recorder's workers (:mod:`outbox.relay.marking`)
take a marking session from ``_free_markers`` and put it back, read ``_rows``, update the
batch they record; a take-over's thread
(:mod:`outbox.relay.rebalancing`) is given its shards, the publisher and the store.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import psycopg

from outbox.engines import sender_engine
from outbox.relay.config import RelayConfig
from outbox.relay.observability import HealthState, RelayMetrics
from outbox.relay.ownership import ShardOwnership
from outbox.relay.producers import TRANSACTION_MARGIN_MS, BatchPublisher, InFlight
from outbox.relay.recording import OutcomeRecorder
from outbox.relay.source import MessageSource
from outbox.relay.store import Failure, HeldRow, PendingRow, RelayStore
from outbox.relay.takeover import TakeOvers
from outbox.relay.wakeup import WakeUp
from outbox.sending import Ack

#: Sessions that mark batches sent, side by side (four measured as fast as two).
MARKERS = 2


@dataclass(eq=False)
class Ended:
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


class RelayState:
    """What the mechanisms of a :class:`~outbox.relay.daemon.Relay` share."""

    def __init__(
        self,
        config: RelayConfig,
        metrics: RelayMetrics | None = None,
        *,
        store: MessageSource | None = None,
        publisher: BatchPublisher | None = None,
    ) -> None:
        """``store`` and ``publisher`` default to the real ones made from ``config``; tests
        pass their own (a publisher standing in for Kafka, say)."""
        self.config = config
        self.owner = f"relay-{uuid.uuid4()}"
        # Not the hot path (that is the owner session): a stale pooled connection after a
        # database restart is replaced instead of failing a take-over or the gauge.
        self.engine = sender_engine(config.database_url, durable=False)
        self.metrics = metrics or RelayMetrics()
        #: Where the messages come from: the loop knows it only as a MessageSource.
        self.store: MessageSource = store or RelayStore(
            self.engine, config.spec, self.owner, config.delete_on_send
        )
        self.store.count_into(self.metrics)
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
        self._recorder: OutcomeRecorder[Ended] = OutcomeRecorder(workers=MARKERS)
        #: Shards gained and being taken over: owned, not read until it ended.
        self._take_overs = TakeOvers()
        #: Shards whose last batch's outcome waits for another transaction's row lock: a
        #: read does not wait for them to be idle (see outbox.relay.reading).
        self._stuck_shards: set[int] = set()
        #: Which group of the owned shards the next read starts with.
        self._group = 0
        #: The last read that found rows took as many as it may, in all or of one shard (a
        #: backlog): the next reads one group of shards.
        self._behind = False
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

    # -- steps one mechanism asks of another (defined by the mechanism named) --------------

    def _shutdown_overdue(self) -> bool:
        """The loop (:mod:`outbox.relay.daemon`)."""
        raise NotImplementedError

    def _collect_recordings(self, block: bool) -> bool:
        """Marking (:mod:`outbox.relay.marking`)."""
        raise NotImplementedError

    def _observe_failures(self, failures: Sequence[Failure], topics: dict[uuid.UUID, str]) -> None:
        """Marking (:mod:`outbox.relay.marking`)."""
        raise NotImplementedError

    def _drain(self, wait_for_held: bool = True) -> None:
        """Marking (:mod:`outbox.relay.marking`)."""
        raise NotImplementedError

    def _held_shards(self) -> set[int]:
        """Marking (:mod:`outbox.relay.marking`)."""
        raise NotImplementedError

    def _finish_take_overs(self, wait_for_all: bool = False) -> None:
        """Rebalancing (:mod:`outbox.relay.rebalancing`)."""
        raise NotImplementedError

    def _lost_database(self, error: Exception) -> None:
        """Sessions (:mod:`outbox.relay.sessions`)."""
        raise NotImplementedError

    def _kafka_reachable(self) -> bool:
        """Serving (:mod:`outbox.relay.serving`)."""
        raise NotImplementedError

    def _refresh_serving(self, now: float) -> None:
        """Serving (:mod:`outbox.relay.serving`)."""
        raise NotImplementedError

    def _stays_aside(self, now: float) -> bool:
        """Serving (:mod:`outbox.relay.serving`)."""
        raise NotImplementedError

    def _take_over_failed(self) -> None:
        """Serving (:mod:`outbox.relay.serving`)."""
        raise NotImplementedError

    def _try_stepping_aside(self, why: str) -> None:
        """Serving (:mod:`outbox.relay.serving`)."""
        raise NotImplementedError
