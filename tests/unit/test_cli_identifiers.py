"""Schema and table names reach SQL as identifiers: every command refuses a name that would
need quoting before it connects anywhere."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from outbox.cli import main

URL = ["--database-url", "postgresql+psycopg://app:pw@127.0.0.1:1/shop"]
COMMANDS = [
    ["db", "upgrade", *URL],
    ["purge", "--older-than", "7d", *URL],
    ["dead", "list", *URL],
    ["relay", "--bootstrap-servers", "127.0.0.1:1", *URL],
    ["reconcile", "--bootstrap-servers", "127.0.0.1:1", *URL],
]
BAD_NAMES = ['a";drop table x;--', "Orders", "bad name", "x" * 80]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize("option", ["--schema", "--table"])
@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_name_that_would_need_quoting_is_refused(
    command: list[str], option: str, name: str
) -> None:
    result = CliRunner().invoke(main, [*command, option, name])
    assert result.exit_code == 2, result.output
    assert any(word in result.output for word in ("identifier", "longer than"))
    assert "Traceback" not in result.output
