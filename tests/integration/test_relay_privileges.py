"""The relay under a least-privilege database role: the documented grants are enough, and a
role without them is refused in one clear line that names what is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlalchemy as sa

from tests.relay_helpers import (
    message_id,
    publish_orders,
    start_relay_process,
    statuses,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_the_documented_grants_are_enough(
    login_role, engine, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    from outbox.devstack.topics import consume_messages

    url = login_role(
        "GRANT USAGE ON SCHEMA public TO {role}",
        "GRANT SELECT, UPDATE ON public.outbox TO {role}",
        prefix="relay",
    )
    topic = make_topic("priv")
    ids = publish_orders(engine, topic, 50)
    relay = start_relay_process(url, bootstrap_servers)
    try:
        wait_for(lambda: statuses(engine) == {"sent": 50}, 60, "50 rows sent")
    finally:
        assert stop_process(relay) == 0
    records = consume_messages(bootstrap_servers, topic, expect=50, timeout=30)
    assert sorted(message_id(r) for r in records) == sorted(ids)


def run_relay(url: str, bootstrap: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", "relay", "--database-url", url,
         "--bootstrap-servers", bootstrap],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    "grants",
    [
        pytest.param((), id="no-rights"),
        pytest.param(("GRANT SELECT ON public.outbox TO {role}",), id="select-only"),
    ],
)
def test_a_role_without_the_grants_is_refused_in_one_line(
    login_role, bootstrap_servers, grants
) -> None:  # type: ignore[no-untyped-def]
    url = login_role(*grants, prefix="relay")
    result = run_relay(url, bootstrap_servers)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "needs SELECT and UPDATE on public.outbox" in lines[0]
    password = sa.make_url(url).password
    assert password and password not in result.stderr + result.stdout
