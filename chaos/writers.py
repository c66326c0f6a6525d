"""Writers: business transactions with outbox messages at a steady rate.

Each writer owns its keys, so a key's messages are made by one writer in order and the order
the relay must keep is the order of the outbox's ``seq``; a scheduled message takes its place
(a new ``seq``) when the relay makes it pending, which the writer does not take turns with
(:mod:`outbox.chaos.visibility`). About one transaction in ten is
rolled back on purpose; its messages must never reach a topic. A transaction whose COMMIT was
interrupted (the database restarted under it) is *uncertain*: it may or may not have
committed, and the audit looks it up.

Most writers are threads of the run. Writer processes (:mod:`outbox.chaos.writer_process`)
run the same loop with a journal: each transaction's message ids are written down before it
commits and confirmed after, so that a writer killed with -9 leaves its last transaction
uncertain, never unaccounted for.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from outbox import Message, Outbox
from outbox.ids import uuid7

#: The topics the writers publish to (and the consuming service reads).
TOPICS = ("chaos.orders", "chaos.payments")
PARTITIONS = 3
BUSINESS_TABLE = "chaos_orders"
ROLLBACK_SHARE = 0.1
#: Messages scheduled a little ahead (seconds, drawn in the range): they take their place in
#: their key's order when due (the relay makes them pending with a new seq), which the
#: audit's per-key order checks (outbox.chaos.visibility).
SCHEDULED_SHARE = 0.05
SCHEDULED_AHEAD = (0.2, 3.0)
KEYS_PER_WRITER = 16

CREATE_BUSINESS_TABLE = f"""
CREATE TABLE IF NOT EXISTS {BUSINESS_TABLE} (
    id uuid PRIMARY KEY,
    writer int NOT NULL,
    message_ids uuid[] NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- The writing transaction and its snapshot, after its messages were written: the
    -- audit's per-key order compares transactions by them (outbox.chaos.visibility).
    xact xid8 NOT NULL DEFAULT pg_current_xact_id(),
    seen pg_snapshot NOT NULL DEFAULT pg_current_snapshot()
)"""


@dataclass
class Tally:
    """What one writer did; ids are outbox message ids."""

    committed: list[uuid.UUID] = field(default_factory=list)
    rolled_back: list[uuid.UUID] = field(default_factory=list)
    uncertain: list[uuid.UUID] = field(default_factory=list)
    transactions: int = 0
    database_errors: int = 0
    #: Each stretch of database errors: (wall-clock time of its first error, of the next
    #: commit, errors in it); the commit's time is None while it lasts.
    outages: list[tuple[float, float | None, int]] = field(default_factory=list)


class Writer(threading.Thread):
    """Writes until :meth:`stop`; ``rate`` is messages per second.

    ``name`` tells the writer's keys apart from every other writer's (a restarted writer
    process takes a new one: what its last life left uncertain says nothing of the order of
    its next). With ``journal``, each transaction is written down there (see the module).
    With ``outbox`` given (say one with an immediate sender), transactions go through its
    ``transaction()`` session; ``hold_open`` is the longest pause, drawn per transaction,
    between writing the rows and committing them, so that a kill lands inside transactions.
    """

    def __init__(
        self,
        index: int,
        database_url: str,
        topics: list[str],
        seed: int,
        rate: float,
        *,
        name: str | None = None,
        outbox: Outbox | None = None,
        journal: TextIO | None = None,
        hold_open: float = 0.0,
    ) -> None:
        super().__init__(name=f"chaos-writer-{index}", daemon=True)
        self.index = index
        self.topics = topics
        self.rate = rate
        self.rng = random.Random(f"{seed}/writer/{name or index}")
        self.keys = [f"{name or f'w{index}'}-k{k}" for k in range(KEYS_PER_WRITER)]
        self.next_n = dict.fromkeys(self.keys, 0)
        self.in_session = outbox is not None
        self.engine = (
            outbox.engine
            if outbox is not None
            else sa.create_engine(database_url, pool_pre_ping=True, pool_size=1)
        )
        self.outbox = outbox or Outbox(self.engine)
        self.journal = journal
        self.hold_open = hold_open
        self.tally = Tally()
        self._stopping = threading.Event()
        self.failure: BaseException | None = None

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        try:
            self._write_until_stopped()
        except BaseException as exc:  # reported by the run, never swallowed
            self.failure = exc
        finally:
            self.engine.dispose()

    def _write_until_stopped(self) -> None:
        due = time.monotonic()
        while not self._stopping.is_set():
            messages = self._draw_messages()
            roll_back = self.rng.random() < ROLLBACK_SHARE
            try:
                self._transaction(messages, roll_back)
            except (sa_exc.OperationalError, sa_exc.InterfaceError):
                # The database went away; a later transaction will try again.
                self.tally.database_errors += 1
                self._note_error()
                self._stopping.wait(0.5)
            else:
                self._note_success()
            # Keep the pace, without a burst to catch up after an outage.
            due = max(due + len(messages) / self.rate, time.monotonic() - 1.0)
            self._stopping.wait(max(0.0, due - time.monotonic()))

    def _note_error(self) -> None:
        outages = self.tally.outages
        if outages and outages[-1][1] is None:
            began, _, errors = outages[-1]
            outages[-1] = (began, None, errors + 1)
        else:
            outages.append((time.time(), None, 1))

    def _note_success(self) -> None:
        outages = self.tally.outages
        if outages and outages[-1][1] is None:
            began, _, errors = outages[-1]
            outages[-1] = (began, time.time(), errors)

    def _draw_messages(self) -> list[Message]:
        messages = []
        for _ in range(self.rng.randint(1, 3)):
            key = self.rng.choice(self.keys)
            n = self.next_n[key]
            self.next_n[key] = n + 1
            topic = self.rng.choice(self.topics)
            ahead = None
            if self.rng.random() < SCHEDULED_SHARE:
                ahead = self.rng.uniform(*SCHEDULED_AHEAD)
            value = {"writer": self.index, "key": key, "n": n}
            messages.append(Message(topic, value, key=key, deliver_after=ahead))
        return messages

    def _transaction(self, messages: list[Message], roll_back: bool) -> None:
        ids: list[uuid.UUID] = []
        committing = False
        insert_business_row = sa.text(
            f"INSERT INTO {BUSINESS_TABLE} (id, writer, message_ids) VALUES (:id, :writer, :ids)"
        )
        try:
            with self._begin() as (bind, finish):
                ids = [r.message_id for r in self.outbox.publish_many(bind, messages)]
                bind.execute(insert_business_row, {"id": uuid7(), "writer": self.index, "ids": ids})
                self._write_down("rollback" if roll_back else "commit", ids)
                if self.hold_open:
                    time.sleep(self.rng.uniform(0.0, self.hold_open))
                if roll_back:
                    self.tally.rolled_back.extend(ids)  # never committed, whatever follows
                    finish(False)
                    return
                committing = True
                finish(True)
            self.tally.committed.extend(ids)
            self.tally.transactions += 1
            self._write_down("committed", ids)
        except (sa_exc.OperationalError, sa_exc.InterfaceError):
            if committing:
                self.tally.uncertain.extend(ids)
                self._write_down("uncertain", ids)
            raise

    @contextmanager
    def _begin(self) -> Iterator[tuple[Session | sa.Connection, Callable[[bool], None]]]:
        """A transaction on a Core connection, or in a session of ``outbox`` (whose
        immediate sender, if any, sends the messages after the commit); yields the bind and
        ``finish(commit)``."""
        if self.in_session:
            with Session(self.engine, expire_on_commit=False) as session:
                session.begin()
                yield session, lambda commit: session.commit() if commit else session.rollback()
            return
        with self.engine.connect() as conn:
            transaction = conn.begin()
            yield conn, lambda commit: transaction.commit() if commit else transaction.rollback()

    def _write_down(self, what: str, ids: list[uuid.UUID]) -> None:
        if self.journal is not None:
            self.journal.write(json.dumps({what: [str(i) for i in ids]}) + "\n")
            self.journal.flush()  # a kill -9 must not take it with the process


def read_journal(lines: Iterable[str]) -> Tally:
    """What a writer process's journal says it did. A transaction written down to commit but
    not confirmed (the process was killed, or the COMMIT interrupted) is uncertain."""
    tally = Tally()
    open_commit: list[uuid.UUID] = []
    for line in lines:
        if not line.strip():
            continue
        try:
            ((what, raw),) = json.loads(line).items()
        except json.JSONDecodeError:
            continue  # torn by a kill while written: before its COMMIT, so never committed
        ids = [uuid.UUID(i) for i in raw]
        if what == "rollback":
            tally.rolled_back.extend(ids)
        elif what == "commit":
            tally.uncertain.extend(open_commit)  # its process died before confirming it
            open_commit = ids
        elif what == "committed":
            tally.committed.extend(ids)
            tally.transactions += 1
            open_commit = []
        elif what == "uncertain":
            tally.uncertain.extend(ids)
            open_commit = []
    tally.uncertain.extend(open_commit)
    return tally
