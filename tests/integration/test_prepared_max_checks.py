"""Check-back's rollback at max checks blocks the step first: with ``--on-max-checks
rollback`` the last check is asked to decide, and only its ROLLBACK (the step blocked) rolls
the message back; an UNKNOWN to it ends the message dead. What earlier versions rolled back
while the step could still happen is listed for an operator, who can still commit it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from outbox import Outbox
from outbox.cli import main
from outbox.prepared import (
    ROLLBACK,
    UNKNOWN,
    CheckMessage,
    CheckRegistry,
    PreparedMessages,
    StepAbandoned,
)
from tests import prepared_app
from tests.integration import test_prepared as base
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def orders(database_url: str) -> Iterator[sa.Engine]:
    engine = prepared_app.create_orders_table(database_url)
    yield engine
    engine.dispose()


def cli(outbox_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--database-url", outbox_url])


def test_a_rollback_at_max_checks_blocks_the_step_first(
    engine: sa.Engine, outbox_url: str, orders: sa.Engine
) -> None:
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP, check_after=0)
    message = prepared.prepare("orders", {"type": "OrderCreated", "order_id": 900}, key=900)
    message_id = message.message_id

    def patient(message: CheckMessage) -> str:  # UNKNOWN for an hour: the step may come
        return prepared_app.STEPS.answer(orders, message, abandon_after=timedelta(hours=1))

    registry = CheckRegistry()
    registry.add_checker(patient, prepared_app.GROUP)
    config = base.fast_config(outbox_url, max_checks=2, on_max_checks="rollback")
    with base.running_checkback(registry, config) as runner:
        wait_for(lambda: base.status_of(engine, message_id) != "prepared", 30, "max checks")
    assert base.status_of(engine, message_id) == "rolled_back"
    # The producer is alive and its step late: it cannot happen any more.
    with pytest.raises(StepAbandoned):
        prepared_app.place_order(orders, 900, message_id)
    assert not prepared_app.order_exists(orders, 900)
    stored = base.row(engine, message_id)
    assert stored["resolved_by"] == "expired" and stored["error_kind"] is None
    assert (stored["check_count"], stored["last_check_answer"]) == (2, "rollback")
    assert base.counter(runner, "expired", prepared_app.GROUP, "rolled_back") == 1


def test_unknown_on_the_last_check_ends_dead_not_rolled_back(
    engine: sa.Engine, outbox_url: str
) -> None:
    # A checker that cannot block the step (a payment provider that keeps saying "pending").
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    message = prepared.prepare("orders", {"n": 1}, group="provider")
    registry = CheckRegistry()
    registry.add_checker(base.answers(UNKNOWN), "provider")
    config = base.fast_config(outbox_url, max_checks=2, on_max_checks="rollback")
    with base.running_checkback(registry, config):
        wait_for(lambda: base.status_of(engine, message.message_id) != "prepared", 30, "end")
    stored = base.row(engine, message.message_id)
    assert (stored["status"], stored["error_kind"]) == ("dead", "unresolved")
    listed = cli(outbox_url, "prepared", "list")
    assert str(message.message_id) in listed.output and "dead" in listed.output


def test_list_shows_rolled_back_messages_whose_step_was_not_blocked(
    engine: sa.Engine, outbox_url: str
) -> None:
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    given_up = prepared.prepare("orders", {"n": 1}, key=1, group="old").message_id
    blocked = prepared.prepare("orders", {"n": 2}, key=2, group="old").message_id
    by_producer = prepared.prepare("orders", {"n": 3}, key=3, group="old")
    by_producer.rollback()
    with engine.begin() as conn:
        # As check-back left a message at max checks before it blocked the step first: all
        # its checks answered UNKNOWN, and it was rolled back all the same.
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = 'rolled_back', resolved_by = 'expired', "
                "resolved_at = now(), check_count = 15, last_check_answer = 'unknown', "
                "error_kind = 'unresolved' WHERE id = :id"
            ),
            {"id": given_up},
        )
    registry = CheckRegistry()
    registry.add_checker(base.answers(ROLLBACK), "old")  # answers ROLLBACK: step blocked
    with base.running_checkback(registry, base.fast_config(outbox_url)):
        wait_for(lambda: base.status_of(engine, blocked) == "rolled_back", 30, "rolled back")
    listed = cli(outbox_url, "prepared", "list", "--unblocked")
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{given_up}  orders  key=1  group=old  ")
    assert "by=expired" in lines[0] and "checks=15" in lines[0] and "last=unknown" in lines[0]
    assert lines[1].startswith("1 rolled-back message(s) whose step was not blocked")
    # The operator who finds the order commits it after all.
    committed = cli(outbox_url, "prepared", "commit", "--after-rollback", str(given_up))
    assert committed.exit_code == 0, committed.output
    stored = base.row(engine, given_up)
    assert (stored["status"], stored["error_kind"]) == ("pending", None)
