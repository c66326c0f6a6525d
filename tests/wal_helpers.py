"""What the WAL source's integration tests share: publishing, reading until, the slot's row."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.wal.reader import Item, WalReader
from outbox.wal.slots import slot_state


def conninfo(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def control(url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        yield conn


def publish(engine: sa.Engine, *messages: Message) -> list[uuid.UUID]:
    """``messages`` in one transaction through the publish API; their ids."""
    with Outbox(engine).transaction() as tx:
        return [r.message_id for r in tx.publish_many(messages)]


def read_until(
    reader: WalReader, done: Callable[[list[Item]], bool], timeout: float = 15.0
) -> list[Item]:
    """Read until ``done(items so far)``; fails after ``timeout`` seconds."""
    items: list[Item] = []
    deadline = time.monotonic() + timeout
    while not done(items):
        assert time.monotonic() < deadline, f"gave up after {timeout}s with {items!r}"
        items += reader.read(1000, 0.2)
    return items


def wait_for(check: Callable[[], bool], timeout: float = 15.0, what: str = "it") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def confirmed_on_server(url: str, slot: str) -> int | None:
    with control(url) as conn:
        state = slot_state(conn, slot)
    return None if state is None else state.confirmed_flush_lsn


def terminate_and_drop(url: str, slot: str) -> None:
    """What an operator does to drop a slot in use: end its reader's session, then drop it."""
    with control(url) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
            " WHERE slot_name = %s AND active_pid IS NOT NULL",
            (slot,),
        )

        def dropped() -> bool:
            try:
                conn.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                    " WHERE slot_name = %s",
                    (slot,),
                )
            except psycopg.errors.ObjectInUse:
                return False  # its session is still on its way out
            return True

        wait_for(dropped, what=f"slot {slot} to be let go")
