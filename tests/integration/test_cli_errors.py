"""Every command that reaches the database, and every daemon, against what waiting cannot fix
(a wrong password, a missing database or table, a role without rights, a URL of a driver
outbox does not use): one clear line on stderr, exit status 2 within seconds, no traceback,
no password. A server that refuses connections may still be starting: the daemons wait for it
up to ``--start-timeout``."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.integration

SECRET = "top-secret-pw-" + secrets.token_hex(4)

#: Far below the daemons' default --start-timeout (60 s), which a failure that waiting cannot
#: fix must not wait out; far above a start on a busy machine (two to five seconds).
FAST = 25.0

NO_KAFKA = ["--bootstrap-servers", "127.0.0.1:1"]
DAEMONS = {
    "relay": ["relay", *NO_KAFKA],
    "consume": ["consume", "tests.inbox_app:inbox", *NO_KAFKA],
    "checkback": ["checkback", "tests.prepared_app:registry"],
}
COMMANDS = {
    **DAEMONS,
    "db upgrade": ["db", "upgrade"],
    "db current": ["db", "current"],
    "purge": ["purge", "--older-than", "7d"],
    "dead list": ["dead", "list"],
    "dead retry": ["dead", "retry", "--all"],
    "prepared list": ["prepared", "list"],
    "prepared rollback": ["prepared", "rollback", "--all"],
    "inbox install": ["inbox", "install"],
    "inbox parked list": ["inbox", "parked", "list"],
    # The database is looked at before Spark starts: its failures cost no JVM.
    "reconcile": ["reconcile", *NO_KAFKA],
}
#: The commands that need a table to exist (the others create it or report that it is missing).
NEED_A_TABLE = sorted(set(COMMANDS) - {"db upgrade", "db current", "inbox install"})


def run(args: list[str], url: str, timeout: float = FAST + 20) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "INBOX_TEST_TOPICS": "orders", "INBOX_TEST_GROUP": "cli-errors"}
    env.pop("OUTBOX_DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", *args, "--database-url", url],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def assert_fails_fast(
    args: list[str], url: str, *expected: str
) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    result = run(args, url)
    took = time.monotonic() - started
    assert_one_clear_line(result, *expected)
    assert took < FAST, f"took {took:.1f}s"
    return result


def assert_one_clear_line(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output  # it could not run (docs/operations.md)
    assert "Traceback" not in output
    assert SECRET not in output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    # A daemon logs in JSON when stderr is not a terminal: its last words are a log line.
    said = json.loads(lines[0])["msg"] if lines[0].startswith("{") else lines[0]
    assert any(word in said for word in expected), lines[0]
    print(lines[0])  # shown with -s: what an operator reads


@pytest.fixture(scope="module")
def no_rights_url(outbox_template: str, postgres_server) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A login role with no grant at all, on a database that has the outbox and inbox tables.
    The role is dropped afterwards: the tests leave nothing on the server."""
    from outbox.inbox import migrate as inbox_migrate

    database = f"norights_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(database, template=outbox_template)
    inbox_migrate.install(url)
    name = f"nobody_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {name} LOGIN PASSWORD '{SECRET}'"))
    engine.dispose()
    try:
        yield sa.make_url(url).set(username=name, password=SECRET).render_as_string(False)
    finally:
        postgres_server.drop_database(database)
        admin = sa.create_engine(postgres_server.url())
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP ROLE IF EXISTS {name}"))
        admin.dispose()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unreachable_database(command: str) -> None:
    url = f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/shop"
    args = COMMANDS[command] + (["--start-timeout", "0"] if command in DAEMONS else [])
    assert_fails_fast(args, url, "database", "connection")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_wrong_password(command: str, outbox_url: str) -> None:
    url = sa.make_url(outbox_url).set(password=SECRET).render_as_string(False)
    assert_fails_fast(COMMANDS[command], url, "password authentication failed")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_missing_database(command: str, outbox_url: str) -> None:
    missing = f"no_such_db_{uuid.uuid4().hex[:8]}"
    url = sa.make_url(outbox_url).set(database=missing).render_as_string(False)
    assert_fails_fast(COMMANDS[command], url, f'database "{missing}" does not exist')


@pytest.mark.parametrize("command", NEED_A_TABLE)
def test_a_missing_table(command: str, database_url: str) -> None:
    assert_fails_fast(COMMANDS[command], database_url, "does not exist", "do not exist")


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"db current"}))
def test_a_role_without_rights(command: str, no_rights_url: str) -> None:
    assert_fails_fast(COMMANDS[command], no_rights_url, "permission denied", "needs", "privilege")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_psycopg2_url_says_what_to_write_instead(command: str) -> None:
    url = f"postgresql+psycopg2://app:{SECRET}@127.0.0.1:1/shop"
    result = assert_fails_fast(COMMANDS[command], url, "postgresql+psycopg://")
    assert "psycopg2" in result.stderr


@pytest.mark.parametrize("scheme", ["postgres", "postgresql"])
def test_postgres_and_postgresql_urls_mean_psycopg(scheme: str, outbox_url: str) -> None:
    url = outbox_url.replace("postgresql+psycopg://", f"{scheme}://", 1)
    assert url.startswith(f"{scheme}://")
    result = run(["db", "current"], url)
    assert result.returncode == 0, result.stderr
    assert "(head)" in result.stdout


@pytest.mark.parametrize("daemon", sorted(DAEMONS))
def test_a_daemon_waits_for_a_refusing_server_until_its_start_timeout(daemon: str) -> None:
    # Connection refused: a server that may still be starting, worth waiting for.
    url = f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/shop"
    started = time.monotonic()
    result = run([*DAEMONS[daemon], "--start-timeout", "3", "--log-format", "text"], url)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert took >= 3, f"gave up after {took:.1f}s"
    assert "database not ready" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and SECRET not in result.stderr
    assert "Connection refused" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("daemon", sorted(DAEMONS))
def test_in_json_every_line_is_json_and_the_fatal_one_comes_last(daemon: str) -> None:
    url = f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/shop"
    result = run([*DAEMONS[daemon], "--start-timeout", "3", "--log-format", "json"], url)
    assert result.returncode == 2, result.stderr
    entries = [json.loads(line) for line in result.stderr.strip().splitlines()]
    # The waits, their folded repeats, then the error that ended it, last.
    assert len(entries) >= 3 and any(entry.get("repeated") for entry in entries), entries
    assert [entry["level"] for entry in entries].count("critical") == 1, entries
    assert entries[-1]["level"] == "critical", entries
    assert "Connection refused" in entries[-1]["msg"] and SECRET not in result.stderr
    assert entries[-1]["exit_code"] == 2


def test_an_embedded_consumer_with_a_wrong_password_stops_at_once(
    outbox_url: str, bootstrap_servers: str
) -> None:
    # The runner in a service's thread, no command line: it must not wait forever either.
    from outbox.errors import ConfigError
    from outbox.inbox import Inbox, InboxRunner
    from tests.inbox_helpers import consumer_config

    url = sa.make_url(outbox_url).set(password=SECRET).render_as_string(False)
    inbox = Inbox(group="embedded-wrong-password")
    inbox.handler("orders")(lambda message, session: None)
    runner = InboxRunner(inbox, consumer_config(url, bootstrap_servers))
    raised: list[BaseException] = []

    def run() -> None:
        try:
            runner.run()
        except ConfigError as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, name="embedded-consumer", daemon=True)
    thread.start()
    thread.join(FAST)
    if thread.is_alive():
        runner.stop()
        thread.join(30)
        pytest.fail(f"the runner still waited for the database after {FAST:.0f}s")
    assert raised and "password authentication failed" in str(raised[0]), raised
    assert SECRET not in str(raised[0])
