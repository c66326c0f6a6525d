"""What a cold review of the relay found: a server that refuses its writes."""

from __future__ import annotations

import threading

import psycopg
import pytest
import sqlalchemy as sa

from outbox.relay.daemon import Relay
from tests.conftest import outbox_conninfo
from tests.relay_helpers import statuses, wait_for
from tests.relay_outside import WatchedRelay
from tests.stub_sender import StubSender, publish, stub_config, stub_relay

pytestmark = pytest.mark.integration


class Watched(WatchedRelay):
    """A WatchedRelay of a relay made here (a stub sender's)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.returned: int | None = None
        self.raised: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-relay", daemon=True)


def test_a_relay_that_meets_a_read_only_server_waits_for_a_writable_one(
    outbox_url: str, engine: sa.Engine, login_role
) -> None:  # type: ignore[no-untyped-def]
    url = login_role(
        "GRANT USAGE ON SCHEMA public TO {role}",
        "GRANT SELECT, UPDATE ON public.outbox TO {role}",
        prefix="relay",
    )
    role = sa.make_url(url).username
    admin = psycopg.connect(outbox_conninfo(outbox_url), autocommit=True)
    # What a relay meets when its URL leads it to a server that takes no writes.
    admin.execute(f"ALTER ROLE {role} SET default_transaction_read_only = on")
    stub = StubSender()
    watched = Watched(stub_relay(stub_config(url), stub))
    watched.thread.start()
    try:
        # Long enough to take its shards and make its first read on the read-only server.
        watched.thread.join(10)
        assert watched.running, watched.ended_because()
        # The server takes writes again (a primary is back behind the URL).
        admin.execute(f"ALTER ROLE {role} RESET default_transaction_read_only")
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        publish(engine, 20, keys=4)
        wait_for(
            lambda: statuses(engine) == {"sent": 20} or not watched.running,
            30,
            "the rows to be sent",
        )
        assert statuses(engine) == {"sent": 20}, watched.ended_because()
    finally:
        watched.stop()
        admin.close()
