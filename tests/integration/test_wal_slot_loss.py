"""A lost slot is said at once, with a typed error, and the outbox table still holds every
message the slot can no longer hand out (the relay recovers from there)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox import Message
from outbox.devstack.postgres import PostgresServer
from outbox.schema import DEFAULT_SPEC
from outbox.wal.errors import SlotLost
from outbox.wal.pgoutput import Commit
from outbox.wal.reader import WalReader
from outbox.wal.slots import slot_name
from tests.wal_helpers import control, publish, read_until, terminate_and_drop, wait_for

pytestmark = pytest.mark.integration

SLOT = slot_name(DEFAULT_SPEC)


def read_and_confirm(url: str, engine: sa.Engine) -> int:
    """Start a reader (making the slot), send one message through it, confirm and stop; the
    position a relay would have recorded."""
    with WalReader(url, heartbeat=None) as reader:
        publish(engine, Message("orders", "first"))
        items = read_until(reader, lambda got: any(isinstance(i, Commit) for i in got))
        end = next(i for i in items if isinstance(i, Commit)).end_lsn
        reader.confirm(end)
    return end


def pending(engine: sa.Engine, ids: list[uuid.UUID]) -> list[uuid.UUID]:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT id FROM outbox WHERE id = ANY(:ids) AND status = 'pending'"),
            {"ids": ids},
        )
        return [row[0] for row in found]


def test_dropped_while_read(outbox_url: str, engine: sa.Engine) -> None:
    reader = WalReader(outbox_url, heartbeat=None)
    reader.start()
    try:
        terminate_and_drop(outbox_url, SLOT)
        committed = publish(engine, Message("orders", "meanwhile"))
        with pytest.raises(SlotLost, match=f"replication slot {SLOT} was dropped") as lost:
            reader.read(100, 1.0)
    finally:
        reader.close()
    assert lost.value.reason == "dropped"
    assert "recover from the outbox table" in str(lost.value)
    assert pending(engine, committed) == committed


def test_made_again_under_the_same_name(outbox_url: str, engine: sa.Engine) -> None:
    recorded = read_and_confirm(outbox_url, engine)
    committed = publish(engine, Message("orders", "while the relay was stopped"))
    with control(outbox_url) as conn:  # a failover manager making the slot it expects
        conn.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))

    with pytest.raises(SlotLost, match="after the position recorded") as lost:
        WalReader(outbox_url, position=recorded).start()
    assert (lost.value.reason, lost.value.position) == ("recreated", recorded)
    assert pending(engine, committed) == committed


def test_missing_at_start(outbox_url: str, engine: sa.Engine) -> None:
    """A promoted standby that never had the slot."""
    recorded = read_and_confirm(outbox_url, engine)
    with control(outbox_url) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
    with pytest.raises(SlotLost, match=f"replication slot {SLOT} does not exist") as lost:
        WalReader(outbox_url, position=recorded).start()
    assert lost.value.reason == "missing"


def test_a_first_start_makes_the_slot(outbox_url: str) -> None:
    with WalReader(outbox_url, heartbeat=None) as reader:
        assert reader.look() is not None


@pytest.fixture
def small_slot_wal_limit(postgres_server: PostgresServer) -> Iterator[None]:
    """max_slot_wal_keep_size at its smallest, on the session's server, for one test."""
    with control(postgres_server.url()) as conn:
        conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        conn.execute("SELECT pg_reload_conf()")
        try:
            yield
        finally:
            conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
            conn.execute("SELECT pg_reload_conf()")


def test_invalidated_while_read(
    outbox_url: str, engine: sa.Engine, small_slot_wal_limit: None
) -> None:
    reader = WalReader(outbox_url, heartbeat=None)
    reader.start()
    try:
        state = reader.look()
        assert state is not None and state.safe_bytes is not None  # the limit applies
        committed = publish(engine, Message("orders", "its WAL goes"))
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE filler (n int)"))
        for _ in range(3):  # WAL past the limit: three segments on
            with engine.begin() as conn:
                conn.execute(sa.text("INSERT INTO filler SELECT generate_series(1, 100)"))
                conn.execute(sa.text("SELECT pg_switch_wal()"))
        with control(outbox_url) as conn:
            conn.execute("CHECKPOINT")  # removes the WAL, and with it the slot
            wait_for(
                lambda: (
                    conn.execute(
                        "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)
                    ).fetchone()
                    == ("lost",)
                ),
                what="the slot to be invalidated",
            )
        with pytest.raises(SlotLost, match="invalidated") as lost:
            read_until(reader, lambda got: False, timeout=10)
    finally:
        reader.close()
    assert lost.value.reason == "invalidated"
    assert pending(engine, committed) == committed
    with pytest.raises(SlotLost, match="invalidated"):
        WalReader(outbox_url).start()  # nor does a new reader take it as it stands
