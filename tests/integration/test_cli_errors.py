"""Every command that reaches the database, against an unreachable server, a wrong password and
a role without rights: one clear line on stderr, a non-zero exit, no traceback, no password."""

from __future__ import annotations

import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.integration

SECRET = "top-secret-pw-" + secrets.token_hex(4)

COMMANDS = {
    "db upgrade": ["db", "upgrade"],
    "db current": ["db", "current"],
    "purge": ["purge", "--older-than", "7d"],
    "dead list": ["dead", "list"],
    "dead retry": ["dead", "retry", "--all"],
    "relay": ["relay", "--bootstrap-servers", "127.0.0.1:1", "--start-timeout", "0"],
    "prepared list": ["prepared", "list"],
    "prepared rollback": ["prepared", "rollback", "--all"],
    "checkback": ["checkback", "tests.prepared_app:registry"],
}


def run(args: list[str], url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", *args, "--database-url", url],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def assert_one_clear_line(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output
    assert SECRET not in output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert any(word in lines[0] for word in expected), lines[0]
    print(lines[0])  # shown with -s: what an operator reads


@pytest.fixture(scope="module")
def no_rights_url(outbox_template: str, postgres_server) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A login role with no grant at all, on a database that has the outbox table."""
    database = f"norights_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(database, template=outbox_template)
    name = f"nobody_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {name} LOGIN PASSWORD '{SECRET}'"))
    engine.dispose()
    yield sa.make_url(url).set(username=name, password=SECRET).render_as_string(False)
    postgres_server.drop_database(database)
    with psycopg.connect(postgres_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"DROP ROLE {name}")  # granted nothing; roles outlive the database


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unreachable_database(command: str) -> None:
    url = f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/shop"
    assert_one_clear_line(run(COMMANDS[command], url), "database", "connection")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_wrong_password(command: str, outbox_url: str) -> None:
    url = sa.make_url(outbox_url).set(password=SECRET).render_as_string(False)
    assert_one_clear_line(run(COMMANDS[command], url), "password authentication failed")


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"db current"}))
def test_a_role_without_rights(command: str, no_rights_url: str) -> None:
    assert_one_clear_line(
        run(COMMANDS[command], no_rights_url), "permission denied", "needs", "privilege"
    )
