"""An idle outbox beside a busy table: heartbeats keep the WAL its slot holds bounded; without
them (a stopped relay) the slot holds all of it, and says how much."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from outbox.wal.reader import Heartbeat, WalReader
from tests.wal_helpers import control, read_until

pytestmark = pytest.mark.integration

#: What the busy table writes: well past the bound below.
BUSY_WAL = 8 * 1024 * 1024
#: After a checkpoint (which logs the running-transactions record a slot moves on), the slot
#: of a reader that confirms its heartbeats holds less than this.
BOUND = 1024 * 1024


def write_busy_table(engine: sa.Engine) -> int:
    """WAL that is not the outbox's, at least BUSY_WAL bytes of it; how much was written."""
    with engine.begin() as conn:
        before = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
        conn.execute(sa.text("CREATE TABLE IF NOT EXISTS busy (n int, filler text)"))
        while True:
            conn.execute(
                sa.text(
                    "INSERT INTO busy SELECT g, repeat('x', 100) FROM generate_series(1, 20000) g"
                )
            )
            written = conn.execute(
                sa.text("SELECT pg_current_wal_lsn() - CAST(:before AS pg_lsn)"), {"before": before}
            ).scalar_one()
            if written >= BUSY_WAL:
                return int(written)


def checkpoint(url: str) -> None:
    with control(url) as conn:
        conn.execute("CHECKPOINT")


def test_heartbeats_keep_the_held_wal_bounded(outbox_url: str, engine: sa.Engine) -> None:
    with WalReader(outbox_url, heartbeat=0.2) as reader:
        written = write_busy_table(engine)
        checkpoint(outbox_url)
        floor = reader.confirmed

        def bounded(items: list[object]) -> bool:
            for item in items:
                if isinstance(item, Heartbeat):
                    reader.confirm(item.lsn)  # nothing before it waits for Kafka
            items.clear()
            held = reader.held_back()
            return held is not None and held < BOUND

        read_until(reader, bounded, timeout=20)
        assert reader.confirmed > floor + written  # it moved past the busy table's WAL


def test_a_stopped_reader_holds_the_wal_and_says_how_much(
    outbox_url: str, engine: sa.Engine
) -> None:
    with WalReader(outbox_url, heartbeat=None) as reader:
        before = reader.held_back()
        written = write_busy_table(engine)
        checkpoint(outbox_url)
        state = reader.look()
    assert before is not None and state is not None and state.held_bytes is not None
    assert state.held_bytes >= before + written
    assert state.wal_status in ("reserved", "extended")
    assert state.safe_bytes is None  # no max_slot_wal_keep_size: nothing caps it


def test_outbox_status_shows_the_slot_and_what_it_holds(outbox_url: str, engine: sa.Engine) -> None:
    from outbox.queries import Queries
    from outbox.schema import DEFAULT_SPEC
    from outbox.status import read_status
    from outbox.status_report import to_json, to_text

    assert read_status(engine, Queries(DEFAULT_SPEC)).wal_slot is None  # table mode: no line
    with WalReader(outbox_url, heartbeat=None):
        pass  # made the slot, then stopped
    written = write_busy_table(engine)

    status = read_status(engine, Queries(DEFAULT_SPEC))

    assert status.wal_slot is not None and status.wal_slot.held_bytes is not None
    assert status.wal_slot.held_bytes >= written
    written_held = status.wal_slot.held_bytes
    line = next(line for line in to_text(status) if line.startswith("WAL slot"))
    assert line.startswith("WAL slot outbox_public_outbox: not read, holds ")
    assert line.endswith("MB of WAL (reserved; no max_slot_wal_keep_size)")
    reported = json.loads(to_json(status))["wal_slot"]
    assert (reported["name"], reported["held_bytes"]) == ("outbox_public_outbox", written_held)
