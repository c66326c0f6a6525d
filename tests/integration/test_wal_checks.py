"""What the server must allow before a WAL reader starts: each refusal is one line, at start."""

from __future__ import annotations

import secrets
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from outbox.devstack.postgres import PostgresServer, data_root_for
from outbox.devstack.procs import free_port
from outbox.schema import DEFAULT_SPEC
from outbox.wal.errors import (
    NoFreeSlot,
    ReplicationNotPermitted,
    SlotInUse,
    WalLevelNotLogical,
)
from outbox.wal.reader import WalReader
from outbox.wal.slots import ensure_publication, slot_state
from tests.wal_helpers import control

pytestmark = pytest.mark.integration


@pytest.fixture
def replica_level_server(tmp_path: Path, postgres_server: PostgresServer) -> Iterator[str]:
    """A cluster of its own with wal_level = replica (PostgreSQL's default); its URL."""
    server = PostgresServer(
        data_root_for(tmp_path), free_port(), secrets.token_urlsafe(12), durable=False
    )
    server.wal_level = "replica"
    try:
        server.start()
        yield server.url()
    finally:
        server.stop("immediate")
        shutil.rmtree(server.root, ignore_errors=True)


def test_wal_level_not_logical(replica_level_server: str) -> None:
    with pytest.raises(WalLevelNotLogical) as refused:
        WalReader(replica_level_server).start()
    assert str(refused.value) == (
        "wal_level is 'replica', not 'logical': set wal_level = logical in postgresql.conf "
        "(on Amazon RDS: rds.logical_replication = 1) and restart PostgreSQL"
    )


def test_a_role_without_replication(outbox_url: str, login_role: Callable[..., str]) -> None:
    url = login_role("GRANT SELECT ON public.outbox TO {role}", prefix="noreplication")
    with pytest.raises(ReplicationNotPermitted, match="may not read a replication slot") as refused:
        WalReader(url).start()
    assert "ALTER ROLE noreplication_" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_replication_role_reads_the_publication_its_owner_made(
    outbox_url: str, login_role: Callable[..., str]
) -> None:
    with control(outbox_url) as conn:
        ensure_publication(conn, DEFAULT_SPEC)
    url = login_role("ALTER ROLE {role} REPLICATION", prefix="walreader")
    with WalReader(url, heartbeat=None) as reader:
        assert reader.read(10, 0.1) == []


def test_no_free_slot(outbox_url: str) -> None:
    taken: list[str] = []
    with control(outbox_url) as conn:
        row = conn.execute(
            "SELECT current_setting('max_replication_slots')::int - count(*)"
            " FROM pg_replication_slots"
        ).fetchone()
        assert row is not None
        try:
            for _ in range(row[0]):
                taken.append(f"filler_{uuid.uuid4().hex[:8]}")
                conn.execute("SELECT pg_create_physical_replication_slot(%s)", (taken[-1],))
            with pytest.raises(NoFreeSlot) as refused:
                WalReader(outbox_url).start()
        finally:
            for name in taken:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    assert "no free replication slot for outbox_public_outbox" in str(refused.value)
    assert "max_replication_slots" in str(refused.value)


def test_one_reader_at_a_time(outbox_url: str) -> None:
    with WalReader(outbox_url, heartbeat=None), control(outbox_url) as conn:
        state = slot_state(conn, "outbox_public_outbox")
        assert state is not None and state.active_pid is not None
        with pytest.raises(SlotInUse, match=f"pid {state.active_pid}"):
            WalReader(outbox_url).start()
