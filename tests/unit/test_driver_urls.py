"""Database URLs of the drivers a service runs: what the commands refuse (and say instead),
what outbox's own connections use, and the URL the Django app's migration builds."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from outbox.engines import database_url, own_driver_url
from outbox.errors import ConfigError


@pytest.mark.parametrize("driver", ["psycopg2", "asyncpg", "pg8000"])
def test_the_commands_refuse_another_drivers_url_and_say_what_to_write(driver: str) -> None:
    with pytest.raises(ConfigError) as refused:
        database_url(f"postgresql+{driver}://app:s3cret@db:5432/shop?sslmode=require")
    said = str(refused.value)
    assert "works for publishing" in said and "psycopg 3" in said
    assert "write postgresql+psycopg://app:***@db:5432/shop?sslmode=require instead" in said
    assert "s3cret" not in said


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("postgres://a:b@h/d", "postgresql+psycopg://a:b@h/d"),
        ("postgresql://a:b@h/d", "postgresql+psycopg://a:b@h/d"),
        ("postgresql+psycopg2://a:b@h/d", "postgresql+psycopg://a:b@h/d"),
        ("postgresql+asyncpg://a:b@h:5433/d", "postgresql+psycopg://a:b@h:5433/d"),
        ("postgresql+psycopg://a:b@h/d", "postgresql+psycopg://a:b@h/d"),
    ],
)
def test_outbox_connects_itself_with_psycopg_whatever_the_services_driver(
    given: str, used: str
) -> None:
    assert own_driver_url(given).render_as_string(hide_password=False) == used


def test_the_django_migration_reaches_the_database_django_connects_to() -> None:
    from outbox.django.migration import database_url as django_url

    def connection(**params: object) -> SimpleNamespace:
        return SimpleNamespace(get_connection_params=lambda: params)

    tcp = connection(
        dbname="shop", user="app", password="p@ss:word", host="db", port="5433",
        sslmode="require", client_encoding="UTF8", cursor_factory=object, prepare_threshold=None,
    )  # fmt: skip
    assert django_url(tcp) == (
        "postgresql+psycopg://app:p%40ss%3Aword@db:5433/shop?client_encoding=UTF8&sslmode=require"
    )
    socket = connection(dbname="shop", user="app", host="/var/run/postgresql", port=5432)
    assert django_url(socket) == (
        "postgresql+psycopg://app@/shop?host=%2Fvar%2Frun%2Fpostgresql&port=5432"
    )


def test_the_django_apps_migrations_bring_the_table_to_the_newest_revision() -> None:
    """A new outbox revision needs a Django migration of outbox.django that runs it."""
    import ast

    from alembic.script import ScriptDirectory

    from outbox.migration_support import alembic_config

    folder = Path(__file__).resolve().parents[2] / "outbox" / "django" / "migrations"
    targets = []
    for path in sorted(folder.glob("[0-9]*.py")):
        calls = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "upgrade_outbox"
        ]
        targets += [ast.literal_eval(call.args[0]) for call in calls]
    heads = ScriptDirectory.from_config(alembic_config("postgresql+psycopg://")).get_heads()
    assert targets and targets[-1] in heads, (targets, heads)
