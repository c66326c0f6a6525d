"""The consumer's and the check-back runner's health, as a supervisor sees it over HTTP: a
database out of reach past the stated limit turns /healthz unhealthy, and /readyz names only
what is out of reach (not Kafka, which the consumer has not asked yet)."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import pytest

from outbox.devstack.procs import free_port
from outbox.inbox import InboxRunner
from outbox.inbox.config import ConsumerConfig
from outbox.prepared import COMMIT, CheckbackConfig, CheckbackRunner, CheckRegistry
from tests import inbox_app
from tests.relay_helpers import running_in_thread, wait_for

pytestmark = pytest.mark.integration


def nowhere() -> str:
    """A database URL where nothing listens."""
    return f"postgresql+psycopg://app:pw@127.0.0.1:{free_port()}/shop"


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def runners() -> dict[str, Any]:
    registry = CheckRegistry()
    registry.add_checker(lambda m: COMMIT, "orders")
    consumer = InboxRunner(
        inbox_app.make_inbox(["orders"], "health"),
        ConsumerConfig(
            database_url=nowhere(),
            kafka={"bootstrap.servers": "127.0.0.1:1"},
            metrics_port=0,
            backoff_base=0.1,
            backoff_max=0.2,
            database_outage_limit=1.0,
        ),
    )
    checkback = CheckbackRunner(
        registry,
        CheckbackConfig(database_url=nowhere(), metrics_port=0, database_outage_limit=1.0),
    )
    return {"consume": consumer, "checkback": checkback}


@pytest.mark.parametrize("daemon", ["consume", "checkback"])
def test_a_database_out_of_reach_past_the_limit_turns_healthz_unhealthy(daemon: str) -> None:
    runner = runners()[daemon]
    with running_in_thread(runner, daemon):
        wait_for(lambda: runner.metrics_address is not None, 10, "the health server")
        port = runner.metrics_address[1]
        status, ready = http_get(port, "/readyz")
        assert status == 503 and "database out of reach" in ready
        assert "Kafka" not in ready  # never asked: not to blame
        wait_for(lambda: http_get(port, "/healthz")[0] == 503, 10, "unhealthy")
        assert "database out of reach for " in http_get(port, "/healthz")[1]
