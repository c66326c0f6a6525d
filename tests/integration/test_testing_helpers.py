"""outbox.testing: what a transaction published (committed, never rolled back), an inbox's
handlers fed without Kafka, throwaway databases, and the pytest plugin as a service uses it
(examples/fastapi_service's own tests, run in a pytest of their own)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox.inbox import Inbox, InboxMessage
from outbox.testing import HandlerFailed, InboxFeeder, PublishedMessages, throwaway_database

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(postgres_server) -> Iterator[str]:  # type: ignore[no-untyped-def]
    with throwaway_database(postgres_server.url(), inbox=True) as made:
        yield made


def test_a_throwaway_database_has_the_tables_and_is_dropped(postgres_server) -> None:  # type: ignore[no-untyped-def]
    with throwaway_database(postgres_server.url(), inbox=True, prefix="gone") as made:
        engine = sa.create_engine(made)
        assert {"outbox", "inbox", "inbox_parked"} <= set(sa.inspect(engine).get_table_names())
        engine.dispose()
    server = sa.create_engine(postgres_server.url())
    with server.connect() as conn:
        name = made.rsplit("/", 1)[1]
        left = conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name})
        assert left.first() is None
    server.dispose()


def test_published_shows_what_committed_and_nothing_of_a_rollback(url: str) -> None:
    published = PublishedMessages(url)
    ob = outbox.Outbox(url)
    with ob.transaction() as tx:
        tx.publish("orders", {"n": 1, "total": Decimal("9.90")}, key="k1", headers={"h": "v"})
        # Inside the transaction: seen through its session only.
        assert published.values("orders", bind=tx.session) == [{"n": 1, "total": "9.90"}]
        published.assert_none()
    with pytest.raises(RuntimeError), ob.transaction() as tx:
        tx.publish("orders", {"n": 2}, key="k2")
        raise RuntimeError("the business step failed")

    message = published.one("orders")
    assert (message.key, message.value, message.status) == (
        b"k1",
        {"n": 1, "total": "9.90"},
        "pending",
    )
    assert message.header("outbox-id") == str(message.id).encode()
    assert message.header("content-type") == b"application/json"
    assert message.header("h") == b"v"
    published.assert_none("payments")
    with pytest.raises(AssertionError, match="expected no message, found 1"):
        published.assert_none()
    published.reset()
    published.assert_none()
    ob.engine.dispose()
    published.close()


def test_published_goes_through_the_real_serializer(url: str) -> None:
    published = PublishedMessages(url)
    ob = outbox.Outbox(url)
    with ob.transaction() as tx, pytest.raises(outbox.SerializationError):
        tx.publish("orders", {"at": datetime.datetime(2026, 1, 2, 3, 4)})  # naive: refused
    published.assert_none()
    ob.engine.dispose()
    published.close()


def ledger_inbox(url: str) -> Inbox:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE ledger (order_id bigint PRIMARY KEY, total numeric)"))
    engine.dispose()
    inbox = Inbox(group="billing")

    @inbox.handler("orders")
    def bill(message: InboxMessage, session: Session) -> None:
        if message.value.get("fail"):
            session.execute(sa.text("INSERT INTO ledger VALUES (-1, 0)"))  # rolled back below
            raise ValueError("no such customer")
        session.execute(
            sa.text("INSERT INTO ledger VALUES (:id, :total)"),
            {"id": message.value["order_id"], "total": Decimal(message.value["total"])},
        )

    return inbox


def ledger(url: str) -> list[tuple[int, Decimal]]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(sa.text("SELECT * FROM ledger ORDER BY 1"))]
    engine.dispose()
    return rows  # type: ignore[return-value]


def test_the_feeder_applies_a_message_once_and_rolls_a_failure_back(url: str) -> None:
    feeder = InboxFeeder(ledger_inbox(url), url)
    message_id = uuid.uuid4()
    first = feeder.feed("orders", {"order_id": 7, "total": Decimal("9.90")}, message_id=message_id)
    again = feeder.feed("orders", {"order_id": 7, "total": Decimal("9.90")}, message_id=message_id)
    assert (first.applied, again.duplicate) == (True, True)
    assert first.message_id == str(message_id)

    with pytest.raises(HandlerFailed, match="no such customer"):
        feeder.feed("orders", {"fail": True})
    assert ledger(url) == [(7, Decimal("9.90"))]  # the failing handler's insert rolled back
    feeder.close()

    parking = InboxFeeder(ledger_inbox_again(url), url, park_failures=True)
    assert parking.feed("orders", {"fail": True}).parked
    parking.close()


def ledger_inbox_again(url: str) -> Inbox:
    inbox = Inbox(group="billing-parking")

    @inbox.handler("orders")
    def bill(message: InboxMessage, session: Session) -> None:
        raise ValueError("always")

    return inbox


def test_what_one_service_published_feeds_the_other(url: str) -> None:
    published = PublishedMessages(url)
    ob = outbox.Outbox(url)
    with ob.transaction() as tx:
        tx.publish("orders", {"order_id": 8, "total": "12.00"}, key=8)
    feeder = InboxFeeder(ledger_inbox(url), url)
    fed = feeder.feed_published(published.one("orders"))
    assert fed.applied and fed.message_id == str(published.one().id)
    assert ledger(url) == [(8, Decimal("12.00"))]
    feeder.close()
    ob.engine.dispose()
    published.close()


def run_example_tests(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "examples/fastapi_service",
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_example_service_tests_run_with_the_plugin(postgres_server) -> None:  # type: ignore[no-untyped-def]
    result = run_example_tests({"OUTBOX_TEST_DATABASE_URL": postgres_server.url()})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "4 passed" in result.stdout


def test_the_plugin_says_what_it_needs_without_a_server() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_TEST_DATABASE_URL"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "examples/fastapi_service",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "OUTBOX_TEST_DATABASE_URL" in result.stdout + result.stderr


def test_the_feeder_runs_coroutine_handlers_with_an_async_session(url: str) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    seen: list[tuple[str, bool]] = []
    inbox = Inbox(group="async-billing")

    @inbox.handler("orders")
    async def bill(message: InboxMessage, session: AsyncSession) -> None:
        await session.execute(sa.text("SELECT 1"))
        seen.append((message.value["order_id"], isinstance(session, AsyncSession)))

    feeder = InboxFeeder(inbox, url)
    assert feeder.feed("orders", {"order_id": "a-1"}).applied
    feeder.close()
    assert seen == [("a-1", True)]


@pytest.mark.parametrize("plugin", ["outbox.testing", "outbox.django.testing"])
def test_a_conftest_that_imports_the_helpers_before_the_plugin_gets_no_warning(
    plugin: str, tmp_path: Path
) -> None:
    """As a service's conftest.py often reads: the helpers imported at the top, the plugin
    named below. pytest could not rewrite the module any more, and would warn about it."""
    (tmp_path / "conftest.py").write_text(
        f"from {plugin} import *  # noqa: F403\n\npytest_plugins = [{plugin!r}]\n"
    )
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "examples.django_service.settings"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-W", "error::pytest.PytestAssertRewriteWarning", str(tmp_path)],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "PytestAssertRewriteWarning" not in result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_the_override_recipe_in_the_docs_is_the_example_services_conftest() -> None:
    """docs/testing.md's fixtures are those examples/fastapi_service/conftest.py runs."""
    docs = (ROOT / "docs" / "testing.md").read_text()
    section = docs[docs.index("## Your own migrations") :]
    block = section[section.index("```python\n") + 10 : section.index("```\n", 10)]
    conftest = (ROOT / "examples" / "fastapi_service" / "conftest.py").read_text()
    for chunk in block.strip().split("\n\n"):
        assert chunk.strip() in conftest, chunk
