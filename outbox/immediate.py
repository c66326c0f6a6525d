"""QMQ-style immediate send: right after commit, the writing process sends its own messages.

How it stays out of the relay's way (no duplicates, no reordering):

1. **Lease.** The sender takes the committed rows with one conditional UPDATE
   (``status = 'pending'`` and no live lease) that records itself as ``lease_owner`` until
   ``lease_until``, and commits. The relay leases rows the same way, so whichever UPDATE
   comes second finds the rows taken and skips them: a row is never sent by both.
2. **Order check.** After its lease is committed, the sender looks for an earlier pending row
   of the same topic and key that it does not hold (one being retried, or leased by the
   relay). Such rows are released at once and left to the relay, which sends a key's messages
   in order.
3. **Produce and mark.** The rest go through one shared idempotent producer; each row Kafka
   acknowledges is marked sent (or deleted, in keep-nothing mode) *only if the sender still
   holds its lease*. Rows that failed are released.
4. **No send left behind.** The producer gets the whole delivery timeout and what Kafka has
   not acknowledged by then is purged from it before the rows are released
   (:mod:`outbox.sending`): the producer retries nothing of a released row. (Bytes already on
   the wire may still be written: then the row is on its topic twice once the relay sends it,
   the duplicate at-least-once allows.)
5. **Crash.** If the process dies anywhere in between, the rows are still ``pending``; once
   the lease runs out (``lease_seconds``, longer than the producer's delivery timeout) the relay
   sends them. The only duplicate possible is the one at-least-once always allows: Kafka
   stored the record but the process died before marking it. That holds next to an
   exactly-once relay too: immediate send does not use Kafka transactions, so a consumer
   that needs exactly-once must deduplicate on the ``outbox-id`` header.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Producer

from outbox.engines import hash_joins_only, sender_engine
from outbox.errors import ConfigError
from outbox.queries import Queries
from outbox.records import OutboxRecord
from outbox.schema import OutboxTableSpec
from outbox.sending import BatchResult, produce_batch, sending_config

log = logging.getLogger(__name__)

#: How long a lease lasts; must exceed the delivery timeout so a slow send ends before it.
DEFAULT_LEASE_SECONDS = 60.0
DELIVERY_TIMEOUT_MS = 15_000
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
    background thread leases, produces and marks. Call :meth:`close` at shutdown.
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
        if lease_seconds * 1000 <= self.delivery_timeout_ms:
            raise ConfigError("lease_seconds must outlast the producer's delivery.timeout.ms")
        config = sending_config(settings, self.delivery_timeout_ms)
        # An engine of its own, planned per statement (see outbox.engines.sender_engine).
        self.engine = sender_engine(engine if isinstance(engine, str) else engine.url)
        self.spec = spec or OutboxTableSpec()
        self.queries = Queries(self.spec)
        self.lease_seconds = lease_seconds
        self.delete_on_send = delete_on_send
        self.batch_size = batch_size
        self.owner = f"immediate-{uuid.uuid4()}"
        self._producer = Producer(config)
        self._sending = threading.Lock()
        self._queue: queue.Queue[_QueueItem] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="outbox-immediate", daemon=True)
        self._thread.start()

    def submit(self, ids: Iterable[uuid.UUID]) -> bool:
        """Queue committed message ids for sending; False when the queue is full.

        A full queue loses nothing: those messages are still pending and the relay sends them.
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
        self._producer.flush(timeout)
        self.engine.dispose()

    def send_now(self, ids: list[uuid.UUID]) -> SendOutcome:
        """Lease, produce and mark ``ids`` in the calling thread.

        One batch at a time: batches of one sender hold their rows under one owner, so the
        order check cannot see one batch's rows from the other, and a purge at one batch's
        deadline would cut the other short.
        """
        with self._sending:
            outcome = SendOutcome()
            records = self._lease(ids, outcome)
            if not records:
                return outcome
            result = BatchResult()
            produce_batch(self._producer, records, result, self.delivery_timeout_ms / 1000)
            self._finish(records, result, outcome)
            return outcome

    # -- internals -------------------------------------------------------------------------

    def _lease(self, ids: list[uuid.UUID], outcome: SendOutcome) -> list[OutboxRecord]:
        with self.engine.begin() as conn:
            rows = (
                conn.execute(
                    self.queries["lease_ids"],
                    {"ids": ids, "owner": self.owner, "lease_seconds": self.lease_seconds},
                )
                .mappings()
                .all()
            )
        leased = {row["id"] for row in rows}
        outcome.left_to_relay.extend(i for i in ids if i not in leased)
        if not rows:
            return []
        with self.engine.begin() as conn:
            blocked = set(
                conn.execute(
                    self.queries["leased_behind_earlier"],
                    {"ids": list(leased), "owner": self.owner, "reach": ORDER_CHECK_REACH},
                ).scalars()
            )
            if blocked:
                conn.execute(self.queries["release"], {"ids": list(blocked), "owner": self.owner})
        outcome.left_to_relay.extend(blocked)
        records = []
        undecodable = []
        for row in sorted(rows, key=lambda r: r["seq"]):
            if row["id"] in blocked:
                continue
            try:
                records.append(OutboxRecord.from_row(dict(row)))
            except ValueError:
                undecodable.append(row["id"])  # the relay dead-letters it with the reason
        if undecodable:
            self._release(undecodable)
            outcome.left_to_relay.extend(undecodable)
        return records

    def _finish(
        self, records: list[OutboxRecord], result: BatchResult, outcome: SendOutcome
    ) -> None:
        acks = {ack.id: ack for ack in result.acks}
        acked = [r.id for r in records if r.id in acks]
        unacked = [r.id for r in records if r.id not in acks]
        for record_id in unacked:
            error = result.errors.get(record_id)
            outcome.failed[record_id] = error.str() if error else "not attempted"
        with self.engine.begin() as conn:
            hash_joins_only(conn)
            if acked and self.delete_on_send:
                conn.execute(self.queries["delete_sent"], {"ids": acked, "owner": self.owner})
            elif acked:
                conn.execute(
                    self.queries["mark_sent"],
                    {
                        "ids": acked,
                        "partitions": [acks[i].partition for i in acked],
                        "offsets": [acks[i].offset for i in acked],
                        "owner": self.owner,
                    },
                )
            if unacked:
                conn.execute(self.queries["release"], {"ids": unacked, "owner": self.owner})
        outcome.sent.extend(acked)

    def _release(self, ids: list[uuid.UUID]) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.queries["release"], {"ids": ids, "owner": self.owner})

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
