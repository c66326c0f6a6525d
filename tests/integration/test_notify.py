"""The commit-time NOTIFY: relays hear of committed rows, never of rolled-back ones."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.schema import DEFAULT_SPEC

pytestmark = pytest.mark.integration


def conninfo(engine: sa.Engine) -> str:
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


def pending_notifies(listener: psycopg.Connection, timeout: float) -> list[str]:
    return [n.channel for n in listener.notifies(timeout=timeout, stop_after=1)]


def test_notify_arrives_only_after_commit(engine: sa.Engine) -> None:
    ob = Outbox(engine)
    with psycopg.connect(conninfo(engine), autocommit=True) as listener:
        listener.execute(f'LISTEN "{DEFAULT_SPEC.notify_channel}"')
        with ob.transaction() as tx:
            tx.publish("orders", b"1")
            tx.publish("orders", b"2")
            assert pending_notifies(listener, 0.5) == []  # inserted, not yet committed
        assert pending_notifies(listener, 5) == [DEFAULT_SPEC.notify_channel]
        assert pending_notifies(listener, 0.3) == []  # repeats within one transaction fold


def test_rolled_back_insert_notifies_nobody(engine: sa.Engine) -> None:
    ob = Outbox(engine)
    with psycopg.connect(conninfo(engine), autocommit=True) as listener:
        listener.execute(f'LISTEN "{DEFAULT_SPEC.notify_channel}"')
        with pytest.raises(RuntimeError), ob.transaction() as tx:
            tx.publish("orders", b"1")
            raise RuntimeError("business failure")
        assert pending_notifies(listener, 1) == []
