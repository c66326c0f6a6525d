"""QMQ-style immediate send: right after commit, the writing process sends its own messages.

How it stays out of the relay's way (no duplicates, no reordering):

1. **Leased when written.** A message published through an :class:`~outbox.Outbox` with an
   immediate sender is inserted already leased to that sender (``lease_owner``), until
   ``lease_until`` = insert time + ``lease_seconds``. The relay never sends a leased row, and
   holds back the later messages of its key, until the lease is given back or runs out: the
   lease is taken in the writing transaction itself, so there is no moment at which both could
   take the row.
2. **Order check.** Before sending, the sender looks for an earlier pending row of the same
   topic and key that it does not hold (one being retried, or in flight with the relay). Such
   rows are released at once and left to the relay, which sends a key's messages in order.
3. **Produce and mark.** The rest go through one shared idempotent producer (the relay's
   sending core, :class:`outbox.flights.IdempotentSender`), and each row Kafka acknowledges is
   marked sent (or deleted, in keep-nothing mode) *only if the sender still holds its lease*.
   Rows that failed are released to the relay.
4. **Never past the lease.** A batch's deadline is the earlier of the delivery timeout and the
   lease's end less a margin (``LEASE_MARGIN``), measured from before the sender read how long
   the lease had left; what Kafka has not acknowledged by then is purged
   (:mod:`outbox.sending`). So the sender has stopped before the relay may take a row over.
   (Bytes already on the wire may still be written: then the row is on its topic twice once the
   relay sends it, the duplicate at-least-once allows.)
5. **Crash.** If the process dies anywhere in between, the rows are still ``pending``; once the
   lease runs out (``lease_seconds``, 12 s by default) the relay sends them. The only duplicate
   possible is the one at-least-once always allows: Kafka stored the record but the process
   died before marking it. That holds next to an exactly-once relay too: immediate send does
   not use Kafka transactions, so a consumer that needs exactly-once must deduplicate on the
   ``outbox-id`` header.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from outbox.engines import sender_engine
from outbox.errors import ConfigError
from outbox.flights import IdempotentSender
from outbox.records import OutboxRecord
from outbox.rows import OutboxRows, pending_row
from outbox.schema import OutboxTableSpec
from outbox.wake import wake_relays

log = logging.getLogger(__name__)

#: How long a row written for immediate send is held for it; the relay sends it after that.
DEFAULT_LEASE_SECONDS = 12.0
DELIVERY_TIMEOUT_MS = 8_000
#: The sender stops sending a lease's rows this long before the lease ends.
LEASE_MARGIN = 1.0
#: How many earlier pending rows of a shard the order check looks at. A deeper backlog means
#: the relay is behind anyway: the rows behind it are left to the relay, which sends in order.
ORDER_CHECK_REACH = 1000


@dataclass
class SendOutcome:
    """What one immediate send did with the ids it was given."""

    sent: list[uuid.UUID] = field(default_factory=list)
    left_to_relay: list[uuid.UUID] = field(default_factory=list)
    failed: dict[uuid.UUID, str] = field(default_factory=dict)


class ImmediateSender:
    """Sends committed outbox rows from the writing process; the relay is the safety net.

    ``submit`` only queues ids (it never blocks the request that committed them); a
    background thread produces and marks. Call :meth:`close` at shutdown.
    """

    def __init__(
        self,
        engine: sa.Engine | str,
        kafka_config: Mapping[str, Any],
        *,
        spec: OutboxTableSpec | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        delete_on_send: bool = False,
        queue_size: int = 10_000,
        batch_size: int = 500,
    ) -> None:
        settings = dict(kafka_config)
        self.delivery_timeout_ms = int(settings.pop("delivery.timeout.ms", DELIVERY_TIMEOUT_MS))
        if lease_seconds <= 2 * LEASE_MARGIN:
            raise ConfigError(f"lease_seconds must be more than {2 * LEASE_MARGIN:.0f}")
        # An engine of its own, planned per statement (see outbox.engines.sender_engine).
        self.engine = sender_engine(engine if isinstance(engine, str) else engine.url)
        self.spec = spec or OutboxTableSpec()
        self.owner = f"immediate-{uuid.uuid4()}"
        self.rows = OutboxRows(self.engine.url, self.spec, self.owner, delete_on_send)
        self.lease_seconds = lease_seconds
        self.batch_size = batch_size
        self._sender = IdempotentSender(settings, self.delivery_timeout_ms)
        self._sending = threading.Lock()
        self._queue: queue.Queue[_QueueItem] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="outbox-immediate", daemon=True)
        self._thread.start()

    def submit(self, ids: Iterable[uuid.UUID]) -> bool:
        """Queue committed message ids for sending; False when the queue is full.

        A full queue loses nothing: those messages are still pending and the relay sends them
        once their lease runs out.
        """
        try:
            self._queue.put_nowait(list(ids))
        except queue.Full:
            log.warning("immediate-send queue full; leaving messages to the relay")
            return False
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far has been handled; False on timeout."""
        handled = threading.Event()
        self._queue.put(handled)
        return handled.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued, then stop the thread and the producer."""
        self.flush(timeout)
        self._queue.put(_CLOSE)
        self._thread.join(timeout)
        self._sender.close(timeout)
        self.rows.close()
        self.engine.dispose()

    def send_now(self, ids: list[uuid.UUID]) -> SendOutcome:
        """Order-check, produce and mark ``ids`` in the calling thread.

        One batch at a time: batches of one sender hold their rows under one owner, so the
        order check cannot see one batch's rows from the other, and a purge at one batch's
        deadline would cut the other short.
        """
        with self._sending:
            outcome = SendOutcome()
            asked_at = time.monotonic()
            records, lease_left = self._clear_to_send(ids, outcome)
            if not records:
                return outcome
            # Stop before the lease can run out: the relay may send the rows after that.
            deadline = min(self.delivery_timeout_ms / 1000, lease_left - LEASE_MARGIN)
            if deadline <= 0:
                outcome.left_to_relay.extend(r.id for r in records)
                self.rows.record_outcome([], released=[r.id for r in records])
                return outcome
            flight = self._sender.start(records, timeout=deadline, started=asked_at)
            while not flight.done():
                self._sender.wait(1.0)
            result = flight.result
            acked = {ack.id for ack in result.acks}
            unacked = [r.id for r in records if r.id not in acked]
            for record_id in unacked:
                error = result.errors.get(record_id)
                outcome.failed[record_id] = error.str() if error else "not attempted"
            self.rows.record_outcome(result.acks, released=unacked)
            outcome.sent.extend(r.id for r in records if r.id in acked)
            return outcome

    # -- internals -------------------------------------------------------------------------

    def _clear_to_send(
        self, ids: list[uuid.UUID], outcome: SendOutcome
    ) -> tuple[list[OutboxRecord], float]:
        """The rows this sender may send now, in order, and the seconds left on their lease;
        rows behind an earlier row of their key are released to the relay."""
        with self.engine.begin() as conn:
            rows = (
                conn.execute(
                    self.rows.queries["clear_to_send"],
                    {"ids": ids, "owner": self.owner, "reach": ORDER_CHECK_REACH},
                )
                .mappings()
                .all()
            )
            if len(rows) < len(set(ids)):
                wake_relays(conn, self.rows.queries)  # rows left to the relay: it sends them
        clear = {row["id"] for row in rows}
        outcome.left_to_relay.extend(i for i in ids if i not in clear)
        records = []
        undecodable = []
        for row in rows:
            decoded = pending_row(row)
            if decoded.record is None:
                undecodable.append(decoded.id)  # the relay dead-letters it with the reason
            else:
                records.append(decoded.record)
        if undecodable:
            self.rows.record_outcome([], released=undecodable)
            outcome.left_to_relay.extend(undecodable)
        lease_left = min((float(row["lease_left"]) for row in rows), default=0.0)
        return records, lease_left

    def _run(self) -> None:
        carried: _QueueItem | None = None
        while True:
            item = carried if carried is not None else self._queue.get()
            carried = None
            if isinstance(item, threading.Event):
                item.set()  # a flush marker: everything before it is done
                continue
            if item is _CLOSE:
                return
            assert isinstance(item, list)
            batch = list(item)
            while len(batch) < self.batch_size:  # gather what else waits, up to one batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(more, list):
                    batch.extend(more)
                else:
                    carried = more
                    break
            self._send_logged(batch)

    def _send_logged(self, batch: list[uuid.UUID]) -> None:
        try:
            outcome = self.send_now(batch)
        except Exception:  # the relay is the safety net; this thread must not die
            log.exception("immediate send failed; %d messages left to the relay", len(batch))
            return
        if outcome.failed:
            reasons = sorted(set(outcome.failed.values()))
            log.warning(
                "immediate send: %d of %d messages failed and stay pending for the relay: %s",
                len(outcome.failed),
                len(batch),
                "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else ""),
            )


_CLOSE = object()
_QueueItem = list[uuid.UUID] | threading.Event | object
