"""The operators' commands (`status`, `topics check`, dead and parked messages by cause)
against an unreachable server, a wrong password and a role without rights: one clear line on
stderr, exit status 2, no traceback, no password (as tests/integration/test_cli_errors.py
asks of the others)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.integration.test_cli_errors import SECRET, assert_one_clear_line, no_rights_url, run

pytestmark = pytest.mark.integration

__all__ = ["no_rights_url"]  # the fixture, shared

COMMANDS = {
    "status": ["status"],
    "status --exact": ["status", "--exact", "--json"],
    "dead list --by-reason": ["dead", "list", "--by-reason"],
    "dead retry --reason": ["dead", "retry", "--reason", "98e6e17c806a"],
    "topics check": ["topics", "check", "--bootstrap-servers", "127.0.0.1:1"],
    "inbox parked list --by-reason": ["inbox", "parked", "list", "--by-reason"],
    "inbox parked retry --reason": ["inbox", "parked", "retry", "--reason", "440e5e86da0a"],
}
#: The outbox database of the role without rights has no inbox tables.
OUTBOX_ONLY = {c for c in COMMANDS if not c.startswith("inbox")}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unreachable_database(command: str) -> None:
    url = f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/shop"
    assert_one_clear_line(run(COMMANDS[command], url), "database", "connection")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_wrong_password(command: str, outbox_url: str) -> None:
    url = sa.make_url(outbox_url).set(password=SECRET).render_as_string(False)
    assert_one_clear_line(run(COMMANDS[command], url), "password authentication failed")


@pytest.mark.parametrize("command", sorted(OUTBOX_ONLY))
def test_a_role_without_rights(command: str, no_rights_url: str) -> None:
    assert_one_clear_line(run(COMMANDS[command], no_rights_url), "permission denied")
