"""A Django service (examples/django_service) publishing through Django's own connection, on a
real PostgreSQL: its tests under pytest-django with Django on psycopg 3 and on psycopg2,
``manage.py migrate`` installing (and ``migrate outbox zero`` dropping) the outbox table, and
a relay sending what a Django view published (docs/django.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = "examples.django_service.settings"

#: Runs pytest (or manage.py) with Django's PostgreSQL backend on psycopg2: psycopg 3, which
#: Django prefers, is hidden while the backend loads (outbox itself still has it).
ON_PSYCOPG2 = """
import sys
sys.modules["psycopg"] = None
import django.db.backends.postgresql.base
from django.db.backends.postgresql.psycopg_any import is_psycopg3
assert not is_psycopg3
del sys.modules["psycopg"]
"""


def django_env(database_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "DATABASE_URL": database_url,
        "PYTHONPATH": str(ROOT),
    }


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def django_database(postgres_server) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """An empty database for the Django service (its NAME; pytest-django makes test_NAME)."""
    name = f"shop_{uuid.uuid4().hex[:10]}"
    url = postgres_server.create_database(name)
    yield url
    postgres_server.drop_database(name)


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_the_example_services_tests_pass_under_pytest_django(
    driver: str, django_database: str
) -> None:
    tests = (
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'examples/django_service']))\n"
    )
    prelude = ON_PSYCOPG2 if driver == "psycopg2" else "import sys\n"
    result = run_python(prelude + tests, django_env(django_database))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "6 passed" in result.stdout, result.stdout[-2000:]


def manage(
    *args: str, env: dict[str, str], driver: str = "psycopg"
) -> subprocess.CompletedProcess[str]:
    prelude = ON_PSYCOPG2 if driver == "psycopg2" else "import sys\n"
    code = (
        prelude
        + "from examples.django_service.__main__ import main\n"
        + f"sys.argv = ['manage.py', *{list(args)!r}]\n"
        + "main()\n"
    )
    result = run_python(code, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_manage_migrate_installs_the_outbox_table_at_the_newest_revision(
    django_database: str,
) -> None:
    from outbox import migrate
    from outbox.schema import OutboxTableSpec

    env = django_env(django_database)
    migrated = manage("migrate", env=env)
    assert "Applying outbox.0001_outbox_table... OK" in migrated.stdout, migrated.stdout
    assert {"outbox", "shop_order", "shop_customer"} <= tables(django_database)
    # `outbox db` sees the same table and revision: the relay and the other commands work.
    assert migrate.revision_of(django_database, OutboxTableSpec()) == head_revision()

    manage("migrate", "outbox", "zero", env=env)
    assert "outbox" not in tables(django_database)
    assert "shop_order" in tables(django_database)


def test_manage_migrate_leaves_a_table_outbox_db_upgrade_made(django_database: str) -> None:
    from outbox import Outbox, migrate
    from outbox.schema import OutboxTableSpec

    migrate.upgrade(django_database)  # installed earlier, the other documented way
    engine = sa.create_engine(django_database)
    with engine.begin() as conn:
        Outbox().publish(conn, "orders", b"kept")
    migrated = manage("migrate", env=django_env(django_database), driver="psycopg2")
    assert "Applying outbox.0001_outbox_table... OK" in migrated.stdout, migrated.stdout
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT value FROM outbox")).scalars().all() == [b"kept"]
    engine.dispose()
    assert migrate.revision_of(django_database, OutboxTableSpec()) == head_revision()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    from outbox.migration_support import alembic_config

    (head,) = ScriptDirectory.from_config(alembic_config("postgresql+psycopg://")).get_heads()
    return head


def test_a_relay_sends_what_a_django_view_published(
    django_database: str, bootstrap_servers: str, make_topic
) -> None:  # type: ignore[no-untyped-def]
    """A view publishes in its atomic() block; `outbox relay` (on the same database, with a
    psycopg 3 URL) sends it; a refused order leaves nothing to send."""
    topic = make_topic("django-orders")
    env = {**django_env(django_database), "ORDERS_TOPIC": topic}
    manage("migrate", env=env)
    code = """
import json, sys
from django.test import Client
import django
django.setup()
from examples.django_service.shop.models import Customer
customer = Customer.objects.create(credit="30.00")
client = Client()
for total in ("20.00", "20.00"):
    body = json.dumps({"customer_id": customer.id, "total": total})
    print(client.post("/orders", body, content_type="application/json").status_code)
"""
    placed = run_python("import sys\n" + code, env)
    assert placed.returncode == 0, placed.stderr[-3000:]
    assert placed.stdout.split() == ["201", "409"]
    sent = relay_until_sent(django_database, bootstrap_servers)
    assert [json.loads(value)["type"] for value in sent] == ["OrderPlaced"]


def relay_until_sent(url: str, bootstrap: str) -> list[bytes]:
    from tests.relay_helpers import wait_for

    relay = subprocess.Popen(
        [str(Path(sys.executable).parent / "outbox"), "relay", "--poll-interval", "0.2"],
        cwd=ROOT,
        env={**os.environ, "OUTBOX_DATABASE_URL": url, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    engine = sa.create_engine(url)
    try:

        def statuses() -> list[tuple[str, bytes]]:
            with engine.connect() as conn:
                return [tuple(r) for r in conn.execute(sa.text("SELECT status, value FROM outbox"))]  # type: ignore[misc]

        wait_for(lambda: [s for s, _ in statuses()] == ["sent"], 60, "the relay's send")
        return [value for _, value in statuses()]
    finally:
        relay.terminate()
        relay.wait(60)
        engine.dispose()
