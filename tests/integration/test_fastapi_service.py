"""examples/fastapi_service served by uvicorn, driven over real HTTP: concurrent orders end up
as rows and as messages on the topic, each once; refused requests leave neither. The database
is made by the example's own Alembic history (its tables and the outbox's)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from outbox.devstack.procs import free_port
from outbox.devstack.topics import consume_messages
from tests.relay_helpers import (
    message_id,
    relay_config,
    running_relay,
    statuses,
    wait_for,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
APP = "examples.fastapi_service.app:app"
ALEMBIC_INI = ROOT / "examples" / "fastapi_service" / "alembic.ini"


@contextmanager
def serving(database_url: str, topic: str, log: Path) -> Iterator[str]:
    """The example under `uvicorn` in a process of its own, as a user runs it; yields its URL."""
    port = free_port()
    env = {**os.environ, "OUTBOX_DATABASE_URL": database_url, "ORDERS_TOPIC": topic}
    with log.open("wb") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", APP, "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert server.poll() is None, f"uvicorn exited: {log.read_text()}"
            try:
                return httpx.get(f"{base}/openapi.json", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 60, "the service to answer")
        yield base
    finally:
        server.terminate()
        # uvicorn shuts down cleanly, then ends itself with the signal it got (as exit 143).
        assert server.wait(30) in (0, -signal.SIGTERM), log.read_text()
        assert "Application shutdown complete" in log.read_text()


def migrate(database_url: str) -> None:
    """`alembic -c examples/fastapi_service/alembic.ini upgrade heads`, as the guide says."""
    subprocess.run(
        [str(Path(sys.executable).parent / "alembic"), "-c", str(ALEMBIC_INI), "upgrade", "heads"],
        cwd=ROOT,
        env={**os.environ, "OUTBOX_DATABASE_URL": database_url},
        check=True,
        capture_output=True,
        timeout=120,
    )


def line(sku: str = "SKU-1", quantity: int = 1, unit_price: str = "12.50") -> dict[str, Any]:
    return {"sku": sku, "quantity": quantity, "unit_price": unit_price}


async def post_all(base: str, requests: list[dict[str, Any]]) -> list[httpx.Response]:
    """Every request at once, each on a connection of its own."""
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        return list(await asyncio.gather(*(client.post("/orders", json=r) for r in requests)))


def create_customer(base: str, credit: str) -> int:
    response = httpx.post(f"{base}/customers", json={"credit": credit}, timeout=10)
    assert response.status_code == 201, response.text
    return int(response.json()["customer_id"])


@pytest.fixture
def service_url(database_url: str) -> str:
    migrate(database_url)
    return database_url


@pytest.fixture
def service_engine(service_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(service_url)
    yield engine
    engine.dispose()


def test_concurrent_orders_reach_the_topic_once_and_refused_ones_never(
    service_engine, service_url, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    engine, outbox_url = service_engine, service_url
    topic = make_topic("orders", partitions=3)
    with serving(outbox_url, topic, tmp_path / "uvicorn.log") as base:
        rich = [create_customer(base, "1000.00") for _ in range(4)]
        tight = create_customer(base, "100.00")
        # 50 requests in parallel: 40 that fit, 10 for a customer whose credit covers three
        # of them (the row lock lets exactly three through), and invalid ones beside them.
        good = [{"customer_id": rich[n % 4], "lines": [line(quantity=2)]} for n in range(40)]
        contested = [{"customer_id": tight, "lines": [line(unit_price="30.00")]}] * 10
        invalid = [
            {"customer_id": rich[0], "lines": []},
            {"customer_id": rich[0], "lines": [line(quantity=0)]},
            {"customer_id": rich[0], "lines": [line(sku="lower case")]},
            {"customer_id": rich[0], "lines": [line(unit_price="-1")]},
            {"customer_id": rich[0], "lines": [line(unit_price="0.001")]},
            {"customer_id": "seven", "lines": [line()]},
            {"lines": [line()]},
        ]
        unknown_customer = [{"customer_id": 10**9, "lines": [line()]}]
        responses = asyncio.run(post_all(base, good + contested + invalid + unknown_customer))

    by_status: dict[int, list[httpx.Response]] = {}
    for response in responses:
        by_status.setdefault(response.status_code, []).append(response)
    assert {code: len(group) for code, group in by_status.items()} == {
        201: 43,
        409: 7,
        422: len(invalid),
        404: 1,
    }
    placed = {uuid.UUID(r.json()["message_id"]): r.json() for r in by_status[201]}
    with engine.connect() as conn:
        orders = dict(conn.execute(sa.text("SELECT id, customer_id FROM orders")).all())
        credit = dict(conn.execute(sa.text("SELECT id, credit FROM customers")).all())
        pending = set(conn.execute(sa.text("SELECT id FROM outbox")).scalars())
    assert set(orders) == {uuid.UUID(p["order_id"]) for p in placed.values()}
    assert list(orders.values()).count(tight) == 3
    assert credit == {**dict.fromkeys(rich, Decimal("750.00")), tight: Decimal("10.00")}
    assert pending == set(placed), "one outbox row per placed order, none for the others"

    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: statuses(engine) == {"sent": 43}, 60, "every order's message sent")
    records = consume_messages(bootstrap_servers, topic, expect=43)
    assert sorted(message_id(r) for r in records) == sorted(placed), "each event exactly once"
    for record in records:
        event = json.loads(record.value())
        response = placed[message_id(record)]
        assert event["type"] == "OrderPlaced"
        assert event["order_id"] == response["order_id"] == record.key().decode()
        assert Decimal(event["total"]) == Decimal(response["total"])
        assert orders[uuid.UUID(event["order_id"])] == event["customer_id"]
