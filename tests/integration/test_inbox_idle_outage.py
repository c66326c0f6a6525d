"""A consumer with nothing to read still notices its database going away: its look for
requeued messages meets the outage, and /healthz turns unhealthy past the limit."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from outbox.chaos.proxy import FaultProxy
from outbox.devstack.procs import free_port
from tests import inbox_app
from tests.inbox_helpers import consumer_config, prepare_database, running_consumer
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def proxied_url(outbox_url: str) -> Iterator[tuple[str, FaultProxy]]:
    """``outbox_url`` reached through a fault proxy, and the proxy."""
    url = sa.make_url(outbox_url)
    assert url.port is not None
    proxy = FaultProxy(free_port(), url.port)
    proxy.start()
    yield url.set(port=proxy.listen_port).render_as_string(hide_password=False), proxy
    proxy.close()


def test_an_idle_consumer_turns_unhealthy_when_its_database_stays_away(
    outbox_url: str,
    proxied_url: tuple[str, FaultProxy],
    bootstrap_servers: str,
    make_topic: Callable[..., str],
) -> None:
    prepare_database(outbox_url).dispose()
    url, proxy = proxied_url
    topic = make_topic("inbox-idle-outage")
    inbox = inbox_app.make_inbox([topic], f"g-{uuid.uuid4().hex[:8]}")
    config = consumer_config(url, bootstrap_servers, database_outage_limit=1.0)
    with running_consumer(inbox, config) as runner:
        wait_for(lambda: runner.health.ready, 30, "ready")
        proxy.drop()  # the database goes away; no record comes to apply
        wait_for(lambda: not runner.health.database_ok, 15, "the outage noticed")
        wait_for(lambda: not runner.health.alive, 15, "unhealthy past the limit")
        assert any("database out of reach" in p for p in runner.health.alive_problems())
        proxy.heal()
        wait_for(lambda: runner.health.database_ok and runner.health.alive, 15, "healthy again")
