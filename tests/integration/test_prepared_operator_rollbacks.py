"""An operator's rollback never leaves a step free to commit without its message: it blocks
the step through the message's checker first, or is refused saying why. What an operator
rolled back anyway can still be committed; a commit after a rollback says where a message
stands; a rolled-back row keeps no ``unresolved`` error kind."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from outbox import NotRolledBack, Outbox
from outbox.cli import main
from outbox.prepared import (
    UNKNOWN,
    CheckRegistry,
    PreparedMessages,
    StepAbandoned,
)
from tests import prepared_app
from tests.integration import test_prepared as base
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def orders_url(database_url: str) -> Iterator[str]:
    prepared_app.create_orders_table(database_url).dispose()
    yield database_url


@pytest.fixture
def orders(orders_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(orders_url)
    yield engine
    engine.dispose()


def cli(outbox_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--database-url", outbox_url])


def operator(outbox_url: str, orders_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``outbox prepared ...`` as an operator runs it, in a process of its own that loads the
    order service's checkers (tests.prepared_app:registry)."""
    environment = {**os.environ, "ORDERS_DATABASE_URL": orders_url}
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", "prepared", *args, "--database-url", outbox_url],
        capture_output=True, text=True, timeout=120, check=False, env=environment,
    )  # fmt: skip


def order_message(prepared: PreparedMessages, order_id: int) -> uuid.UUID:
    message = prepared.prepare(
        "orders", {"type": "OrderCreated", "order_id": order_id}, key=order_id
    )
    return message.message_id


# -- an operator's rollback ---------------------------------------------------------------------


def test_an_operator_rollback_is_refused_while_the_step_may_still_commit(
    engine: sa.Engine, outbox_url: str, orders_url: str, orders: sa.Engine
) -> None:
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP, check_after=3600)
    message_id = order_message(prepared, 800)
    ident = str(message_id)
    # Two seconds old, never checked, its producer alive: the step's transaction is open.
    with orders.begin() as step:
        prepared_app.STEPS.record(step, message_id)
        step.execute(sa.text("INSERT INTO orders (id, total) VALUES (800, 1)"))
        plain = cli(outbox_url, "prepared", "rollback", ident)
        assert plain.exit_code == 2, plain.output  # refused: it could not roll back
        assert "its step may still commit" in plain.output
        assert "--checker MODULE:REGISTRY" in plain.output  # what to do
        by_group = cli(outbox_url, "prepared", "rollback", "--group", prepared_app.GROUP)
        assert by_group.exit_code == 2 and "its step may still commit" in by_group.output
        # Through its checker: the step holds the id, so the checker cannot block it.
        checked = operator(
            outbox_url, orders_url, "rollback", "--checker", "tests.prepared_app:registry", ident
        )
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert checked.stdout == "rolled back 0 prepared message(s)\n"
        assert f"{ident}: not rolled back: its checker failed (StepInProgress" in checked.stderr
        assert base.status_of(engine, message_id) == "prepared"
    # The step commits, then its producer commits the message: it was never rolled back.
    prepared.commit(message_id)
    assert base.status_of(engine, message_id) == "pending"
    assert prepared_app.order_exists(orders, 800)


def test_an_operator_rollback_through_the_checker_blocks_the_step_first(
    engine: sa.Engine, outbox_url: str, orders_url: str, orders: sa.Engine
) -> None:
    # A checker that waits an hour before it abandons a message: the operator's rollback
    # must decide now, so the checker blocks the step all the same.
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP, check_after=3600)
    message_id = order_message(prepared, 801)
    done_id = order_message(prepared, 802)
    prepared_app.place_order(orders, 802, done_id)  # this step happened: not rolled back
    rolled = operator(
        outbox_url,
        orders_url,
        "rollback",
        "--checker",
        "tests.prepared_app:registry",
        str(message_id),
        str(done_id),
    )
    assert rolled.returncode == 1, rolled.stdout + rolled.stderr
    assert rolled.stdout == "rolled back 1 prepared message(s)\n"
    assert f"{done_id}: not rolled back: its checker answers COMMIT" in rolled.stderr
    stored = base.row(engine, message_id)
    assert (stored["status"], stored["resolved_by"]) == ("rolled_back", "operator")
    assert stored["last_check_answer"] == "rollback"
    assert base.status_of(engine, done_id) == "prepared"  # check-back commits it
    # The producer was alive, its step slow: it comes now, and cannot happen.
    with pytest.raises(StepAbandoned):
        prepared_app.place_order(orders, 801, message_id)
    assert not prepared_app.order_exists(orders, 801)
    # A step blocked first is not among the rollbacks whose step may have happened.
    unblocked = cli(outbox_url, "prepared", "list", "--unblocked")
    assert str(message_id) not in unblocked.output


def test_an_operator_can_commit_after_a_rollback_of_their_own(
    engine: sa.Engine, outbox_url: str, orders: sa.Engine
) -> None:
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP, check_after=3600)
    message_id = order_message(prepared, 803)
    ident = str(message_id)
    forced = cli(outbox_url, "prepared", "rollback", "--step-cannot-happen", ident)
    assert forced.exit_code == 0, forced.output
    assert forced.output == "rolled back 1 prepared message(s)\n"
    # The operator was wrong: nothing blocked the step, and it commits.
    prepared_app.place_order(orders, 803, message_id)
    listed = cli(outbox_url, "prepared", "list", "--unblocked")
    assert listed.exit_code == 0, listed.output
    assert ident in listed.output and "by=operator" in listed.output
    committed = cli(outbox_url, "prepared", "commit", "--after-rollback", ident)
    assert committed.exit_code == 0, committed.output
    assert base.status_of(engine, message_id) == "pending"
    assert ident not in cli(outbox_url, "prepared", "list", "--unblocked").output
    both = cli(
        outbox_url, "prepared", "rollback", "--step-cannot-happen", "--checker", "m:r", "--all"
    )
    assert both.exit_code == 2 and "not both" in both.output


# -- a commit after a rollback, and what a rolled-back row keeps -------------------------------


def test_commit_after_rollback_of_a_message_still_prepared_says_so(
    engine: sa.Engine, outbox_url: str
) -> None:
    prepared = PreparedMessages(Outbox(engine), check_after=3600)
    message = prepared.prepare("orders", {"n": 1})
    with pytest.raises(NotRolledBack, match="is still prepared") as refused:
        prepared.commit(message.message_id, after_rollback=True)
    assert (refused.value.status, refused.value.message_id) == ("prepared", message.message_id)
    ident = str(message.message_id)
    by_hand = cli(outbox_url, "prepared", "commit", "--after-rollback", ident)
    assert by_hand.exit_code == 1
    assert f"message {ident} is still prepared, not rolled back" in by_hand.output
    assert f"`outbox prepared commit {ident}`" in by_hand.output  # what to do
    assert base.status_of(engine, message.message_id) == "prepared"


def test_a_message_that_ends_rolled_back_keeps_no_unresolved_error_kind(
    engine: sa.Engine, outbox_url: str
) -> None:
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    late = prepared.prepare("orders", {"n": 1}, group="gave-up")
    forced = prepared.prepare("orders", {"n": 2}, group="gave-up")
    registry = CheckRegistry()
    registry.add_checker(base.answers(UNKNOWN), "gave-up")
    with base.running_checkback(registry, base.fast_config(outbox_url, max_checks=1)):
        wait_for(lambda: base.status_of(engine, forced.message_id) == "dead", 30, "dead")
        wait_for(lambda: base.status_of(engine, late.message_id) == "dead", 30, "dead")
    late.rollback()  # its producer, late: the step did not happen
    stored = base.row(engine, late.message_id)
    assert (stored["status"], stored["error_kind"]) == ("rolled_back", None)
    done = cli(outbox_url, "prepared", "rollback", "--step-cannot-happen", str(forced.message_id))
    assert done.exit_code == 0, done.output
    for message in (late, forced):
        stored = base.row(engine, message.message_id)
        assert (stored["status"], stored["error_kind"]) == ("rolled_back", None)
        assert stored["last_error"] == "no verdict after 1 checks (0 failed; last answer: unknown)"
