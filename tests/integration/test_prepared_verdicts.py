"""Undecided never silently becomes rolled back: a checker's failures are counted apart from
its UNKNOWN answers and never end a message rolled back; what check-back rolled back an
operator can still commit; the operator's commands say when they changed nothing."""

from __future__ import annotations

import threading

import pytest
from click.testing import CliRunner, Result

from outbox import NotPrepared, Outbox
from outbox.cli import main
from outbox.prepared import (
    DEAD_AT_MAX,
    ROLLBACK,
    UNKNOWN,
    CheckbackConfig,
    CheckMessage,
    CheckRegistry,
    PreparedMessages,
)
from tests.integration import test_prepared as base
from tests.relay_helpers import relay_config, running_relay, wait_for

pytestmark = pytest.mark.integration


def cli(outbox_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--database-url", outbox_url])


def test_the_default_end_after_max_checks_leaves_the_decision_to_an_operator() -> None:
    assert CheckbackConfig(database_url="postgresql://unused").on_max_checks == DEAD_AT_MAX
    assert CheckbackConfig(database_url="postgresql://unused").end_status == "dead"


def test_failed_checks_never_end_a_message_rolled_back(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    outage = prepared.prepare("orders", {"n": 1}, group="outage")
    unsure = prepared.prepare("orders", {"n": 2}, group="unsure")
    undecided = prepared.prepare("orders", {"n": 3}, group="undecided")
    release = threading.Event()

    def orders_database_down(message: CheckMessage) -> str:
        if message.checks == 0:
            raise ConnectionError("orders database unreachable")
        if message.checks == 1:
            release.wait(30)  # past the check timeout: a timeout
        return UNKNOWN

    def blocks_when_asked_to_decide(message: CheckMessage) -> str:
        return ROLLBACK if message.final else UNKNOWN

    registry = CheckRegistry()
    registry.add_checker(orders_database_down, "outage")
    registry.add_checker(blocks_when_asked_to_decide, "unsure")
    registry.add_checker(base.answers(UNKNOWN), "undecided")
    # Even where the group asks for a rollback at max_checks, only a ROLLBACK to the last
    # check (asked to decide: the checker blocked the step) earns one.
    config = base.fast_config(outbox_url, max_checks=3, on_max_checks="rollback", check_timeout=0.5)
    try:
        with base.running_checkback(registry, config) as runner:
            wait_for(lambda: base.status_of(engine, outage.message_id) == "dead", 30, "dead")
            wait_for(lambda: base.status_of(engine, unsure.message_id) != "prepared", 30, "ended")
            wait_for(lambda: base.status_of(engine, undecided.message_id) == "dead", 30, "dead")
    finally:
        release.set()
    failed = base.row(engine, outage.message_id)
    assert (failed["check_count"], failed["check_failures"]) == (3, 2)
    assert failed["error_kind"] == "unresolved" and failed["resolved_by"] is None
    assert failed["last_error"] == "no verdict after 3 checks (2 failed; last answer: unknown)"
    blocked = base.row(engine, unsure.message_id)
    assert (blocked["status"], blocked["resolved_by"]) == ("rolled_back", "expired")
    assert (blocked["check_count"], blocked["last_check_answer"]) == (3, "rollback")
    assert blocked["error_kind"] is None
    never_blocked = base.row(engine, undecided.message_id)
    assert (never_blocked["status"], never_blocked["error_kind"]) == ("dead", "unresolved")
    assert never_blocked["check_failures"] == 0
    assert base.counter(runner, "checks", "outage", "error") == 1
    assert base.counter(runner, "checks", "outage", "timeout") == 1
    assert base.counter(runner, "checks", "outage", "unknown") == 1
    assert base.counter(runner, "expired", "outage", "dead") == 1
    assert base.counter(runner, "expired", "unsure", "rolled_back") == 1
    assert base.counter(runner, "resolved", "unsure", "rollback") == 0
    assert base.counter(runner, "expired", "undecided", "dead") == 1
    listed = cli(outbox_url, "prepared", "list")
    assert f"{outage.message_id}" in listed.output and "checks=3  failed=2" in listed.output


def test_an_operator_commits_a_message_check_back_rolled_back(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("prep-after-rollback")
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    wrongly = prepared.prepare(topic, {"n": 1}, key=1, group="lies")
    by_producer = prepared.prepare(topic, {"n": 2}, key=2, group="lies")
    by_producer.rollback()
    registry = CheckRegistry()
    registry.add_checker(base.answers(ROLLBACK), "lies")
    with base.running_checkback(registry, base.fast_config(outbox_url)):
        wait_for(lambda: base.status_of(engine, wrongly.message_id) == "rolled_back", 20, "rb")
    ident = str(wrongly.message_id)

    # Without --after-rollback nothing changes, and the command says so by its exit code.
    plain = cli(outbox_url, "prepared", "commit", ident)
    assert plain.exit_code == 1
    assert plain.output.splitlines()[0] == "committed 0 prepared message(s)"
    # The application learns the same from NotPrepared, with the way out.
    with pytest.raises(NotPrepared, match="after_rollback=True"):
        wrongly.commit()
    # One its producer rolled back stays rolled back.
    refused = cli(outbox_url, "prepared", "commit", "--after-rollback", str(by_producer.message_id))
    assert refused.exit_code == 1 and "committed 0" in refused.output
    assert base.status_of(engine, by_producer.message_id) == "rolled_back"
    misused = cli(outbox_url, "prepared", "commit", "--after-rollback", "--all")
    assert misused.exit_code == 2 and "message ids only" in misused.output

    committed = cli(outbox_url, "prepared", "commit", "--after-rollback", ident)
    assert committed.exit_code == 0, committed.output
    assert committed.output == "committed 1 prepared message(s)\n"
    stored = base.row(engine, wrongly.message_id)
    assert (stored["status"], stored["resolved_by"]) == ("pending", "operator")
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: base.status_of(engine, wrongly.message_id) == "sent", 30, "sent")
    assert base.published(bootstrap_servers, topic, expect=1) == [wrongly.message_id]
    # Committed now: doing it again changes nothing, and says so.
    again = cli(outbox_url, "prepared", "commit", "--after-rollback", ident)
    assert again.exit_code == 1


def test_the_api_commits_after_a_check_back_rollback(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    message = prepared.prepare("orders", {"n": 1}, group="api-lies")
    registry = CheckRegistry()
    registry.add_checker(base.answers(ROLLBACK), "api-lies")
    with base.running_checkback(registry, base.fast_config(outbox_url)):
        wait_for(lambda: base.status_of(engine, message.message_id) == "rolled_back", 20, "rb")
    prepared.commit(message.message_id, after_rollback=True)
    assert base.status_of(engine, message.message_id) == "pending"
    prepared.commit(message.message_id, after_rollback=True)  # already committed: nothing


def test_rollback_of_nothing_exits_non_zero(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    nothing = cli(outbox_url, "prepared", "rollback", "--all")
    assert nothing.exit_code == 1 and nothing.output == "rolled back 0 prepared message(s)\n"
    prepared = PreparedMessages(Outbox(engine), group="ops")
    one = prepared.prepare("orders", {"n": 1})
    done = cli(outbox_url, "prepared", "rollback", "--step-cannot-happen", "--all")
    assert done.exit_code == 0 and done.output == "rolled back 1 prepared message(s)\n"
    assert base.status_of(engine, one.message_id) == "rolled_back"
