"""Writers: threads committing business transactions with outbox messages at a steady rate.

Each writer owns its keys, so a key's messages are made by one thread in order and the order
the relay must keep is the order of the outbox's ``seq``. About one transaction in ten is
rolled back on purpose; its messages must never reach a topic. A transaction whose COMMIT was
interrupted (the database restarted under it) is *uncertain*: it may or may not have
committed, and the audit looks it up.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from outbox import Message, Outbox
from outbox.ids import uuid7

#: The topics the writers publish to (and the consuming service reads).
TOPICS = ("chaos.orders", "chaos.payments")
PARTITIONS = 3
BUSINESS_TABLE = "chaos_orders"
ROLLBACK_SHARE = 0.1
KEYS_PER_WRITER = 16

CREATE_BUSINESS_TABLE = f"""
CREATE TABLE IF NOT EXISTS {BUSINESS_TABLE} (
    id uuid PRIMARY KEY,
    writer int NOT NULL,
    message_ids uuid[] NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)"""


@dataclass
class Tally:
    """What one writer did; ids are outbox message ids."""

    committed: list[uuid.UUID] = field(default_factory=list)
    rolled_back: list[uuid.UUID] = field(default_factory=list)
    uncertain: list[uuid.UUID] = field(default_factory=list)
    transactions: int = 0
    database_errors: int = 0


class Writer(threading.Thread):
    """Writes until :meth:`stop`; ``rate`` is messages per second."""

    def __init__(
        self, index: int, database_url: str, topics: list[str], seed: int, rate: float
    ) -> None:
        super().__init__(name=f"chaos-writer-{index}", daemon=True)
        self.index = index
        self.topics = topics
        self.rate = rate
        self.rng = random.Random(f"{seed}/writer/{index}")
        self.keys = [f"w{index}-k{k}" for k in range(KEYS_PER_WRITER)]
        self.next_n = dict.fromkeys(self.keys, 0)
        self.engine = sa.create_engine(database_url, pool_pre_ping=True, pool_size=1)
        self.outbox = Outbox(self.engine)
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
                self._stopping.wait(0.5)
            # Keep the pace, without a burst to catch up after an outage.
            due = max(due + len(messages) / self.rate, time.monotonic() - 1.0)
            self._stopping.wait(max(0.0, due - time.monotonic()))

    def _draw_messages(self) -> list[Message]:
        messages = []
        for _ in range(self.rng.randint(1, 3)):
            key = self.rng.choice(self.keys)
            n = self.next_n[key]
            self.next_n[key] = n + 1
            topic = self.rng.choice(self.topics)
            messages.append(Message(topic, {"writer": self.index, "key": key, "n": n}, key=key))
        return messages

    def _transaction(self, messages: list[Message], roll_back: bool) -> None:
        ids: list[uuid.UUID] = []
        committing = False
        try:
            with self.engine.connect() as conn:
                transaction = conn.begin()
                ids = [r.message_id for r in self.outbox.publish_many(conn, messages)]
                conn.execute(
                    sa.text(
                        f"INSERT INTO {BUSINESS_TABLE} (id, writer, message_ids) "
                        "VALUES (:id, :writer, :ids)"
                    ),
                    {"id": uuid7(), "writer": self.index, "ids": ids},
                )
                if roll_back:
                    self.tally.rolled_back.extend(ids)  # never committed, whatever follows
                    transaction.rollback()
                    return
                committing = True
                transaction.commit()
            self.tally.committed.extend(ids)
            self.tally.transactions += 1
        except (sa_exc.OperationalError, sa_exc.InterfaceError):
            if committing:
                self.tally.uncertain.extend(ids)
            raise
