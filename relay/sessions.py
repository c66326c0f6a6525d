"""The relay's sessions: opening them, and letting go of everything when one is lost.

Invariant: reads and marks act only for a relay whose owner session still lives. The owner
session holds the shards' advisory locks (see :mod:`outbox.relay.ownership`) and LISTENs;
beside it, one session reads batches and :data:`~outbox.relay.state.MARKERS` sessions mark
them. Their reads and marks first check a lock the owner session takes under a random key
when it connects (``_owner_key``; the owner_alive query): once the owner session is gone they
touch nothing, so a shard whose lock went with it is never read or marked by this relay while
another relay may own it. A relay whose sessions cannot see that lock does not connect.

When any session is lost (``_lost_database``), the relay stops sending what Kafka has not
acknowledged, forgets every batch in flight or being recorded (their rows stay pending, to be
read again by whoever owns the shards next, or marked from the progress record
exactly-once), abandons the marks being recorded before their sessions close, lets the shards
go, and opens all its sessions anew before it reads again.

Assumes: once abandoned, the recorder (:mod:`outbox.relay.recording`) has no statement running
and forgets what it was recording; a mark is bound to the sessions it was submitted on
(:mod:`outbox.relay.marking`); the loop reconnects (``_connect``) at the start of every round.
"""

from __future__ import annotations

import logging
import queue
import secrets
import uuid
from typing import Any

import psycopg
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from outbox.relay.observability import mask_secrets
from outbox.relay.ownership import ShardOwnership
from outbox.relay.producers import (
    KAFKA_LOG,
    AtLeastOncePublisher,
    BatchPublisher,
    ExactlyOncePublisher,
)
from outbox.relay.progress import ensure_progress_topic
from outbox.relay.state import MARKERS, RelayState
from outbox.relay.store import MARK_LOCK_TIMEOUT_MS
from outbox.relay.wakeup import WakeUp

log = logging.getLogger("outbox.relay")


class RelaySessions(RelayState):
    """The relay's sessions and publisher (a part of :class:`~outbox.relay.daemon.Relay`)."""

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
        self._stuck_shards.clear()
        self._rows.clear()
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
