"""Prepared messages with check-back on the real PostgreSQL and Kafka: invisible until
committed, in key order from their commit, decided by their checker when the producer dies,
never published once rolled back, never lost once committed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox import (
    InvalidAnswer,
    InvalidTopic,
    Message,
    NotPrepared,
    Outbox,
    OutboxError,
    PermissionDenied,
)
from outbox.cli import main
from outbox.devstack.procs import free_port
from outbox.devstack.topics import consume_messages
from outbox.errors import ConfigError
from outbox.immediate import ImmediateSender
from outbox.prepared import (
    COMMIT,
    ROLLBACK,
    UNKNOWN,
    CheckbackConfig,
    CheckbackRunner,
    CheckMessage,
    CheckRegistry,
    PreparedMessages,
)
from tests import prepared_app
from tests.relay_helpers import (
    STARTED,
    RelayProcess,
    message_id,
    relay_config,
    running_in_thread,
    running_relay,
    start_relay_process,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def orders_url(database_url: str) -> str:
    """The order service's own database, beside the outbox's on the same cluster."""
    prepared_app.create_orders_table(database_url).dispose()
    return database_url


@pytest.fixture
def orders(orders_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(orders_url)
    yield engine
    engine.dispose()


def fast_config(url: str, **overrides: Any) -> CheckbackConfig:
    options: dict[str, Any] = {
        "database_url": url,
        "check_timeout": 2.0,
        "poll_interval": 0.1,
        "check_interval": 0.2,
        "backoff_max": 0.4,
        "count_interval": 0.2,
    }
    options.update(overrides)
    return CheckbackConfig(**options)


def running_checkback(
    registry: CheckRegistry, config: CheckbackConfig
) -> AbstractContextManager[CheckbackRunner]:
    return running_in_thread(CheckbackRunner(registry, config), "checkback")


def row(engine: sa.Engine, message_id: uuid.UUID) -> sa.RowMapping:
    with engine.connect() as conn:
        return (
            conn.execute(sa.text("SELECT * FROM outbox WHERE id = :id"), {"id": message_id})
            .mappings()
            .one()
        )


def status_of(engine: sa.Engine, message_id: uuid.UUID) -> str:
    return str(row(engine, message_id)["status"])


def published(bootstrap: str, topic: str, expect: int, **options: Any) -> list[uuid.UUID]:
    """The outbox ids on ``topic``, in partition order."""
    return [message_id(m) for m in consume_messages(bootstrap, topic, expect=expect, **options)]


def counter(runner: CheckbackRunner, metric: str, *labels: str) -> float:
    value: float = getattr(runner.metrics, metric).labels(*labels)._value.get()
    return value


def answers(*script: str) -> Callable[[CheckMessage], str]:
    """A checker answering from ``script`` by the number of checks made so far (the last
    answer repeats)."""
    return lambda message: script[min(message.checks, len(script) - 1)]


# -- the API ----------------------------------------------------------------------------------


def test_a_prepared_message_is_invisible_until_committed_and_keeps_its_id(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("prep")
    prepared = PreparedMessages(Outbox(engine))
    kept = prepared.prepare(topic, {"order_id": 1}, key=1)
    dropped = prepared.prepare(topic, {"order_id": 2}, key=1)
    assert status_of(engine, kept.message_id) == "prepared"
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        assert published(bootstrap_servers, topic, expect=0, timeout=3) == []
        kept.commit()
        dropped.rollback()
        wait_for(lambda: status_of(engine, kept.message_id) == "sent", 30, "the commit sent")
    assert published(bootstrap_servers, topic, expect=1) == [kept.message_id]
    stored = row(engine, kept.message_id)
    assert (stored["resolved_by"], stored["check_count"]) == ("producer", 0)
    assert stored["prepared_at"] <= stored["created_at"]  # created_at: the commit's time
    assert status_of(engine, dropped.message_id) == "rolled_back"
    # Deciding again the same way does nothing; the other way is refused, typed.
    kept.commit()
    dropped.rollback()
    with pytest.raises(NotPrepared, match="already committed"):
        kept.rollback()
    with pytest.raises(NotPrepared, match="already rolled back") as refused:
        dropped.commit()
    assert refused.value.status == "rolled_back"
    with pytest.raises(NotPrepared, match="no prepared message"):
        prepared.commit(uuid.uuid4())


def test_bad_input_is_refused_before_anything_is_written(engine) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine))
    ran: list[uuid.UUID] = []
    with pytest.raises(InvalidTopic):
        prepared.send_in_transaction(Message("bad topic!", {}), lambda mid: ran.append(mid))
    with pytest.raises(ConfigError):
        prepared.prepare("orders", {}, group="")
    with pytest.raises(ConfigError):
        prepared.prepare("orders", {}, check_after=-1)
    with pytest.raises(ConfigError):
        prepared.send_in_transaction(Message("orders", {}), "not callable")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        PreparedMessages(Outbox(engine), check_after=float("nan"))
    for huge in (1e13, 10**20):  # would overflow the database's interval
        with pytest.raises(ConfigError, match="ten years"):
            prepared.prepare("orders", {}, check_after=huge)
    assert ran == []
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 0


def test_send_in_transaction_does_what_the_local_transaction_answers(engine) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), group="shop")
    results = {
        answer: prepared.send_in_transaction(
            Message("orders", {"a": answer}), lambda _, a=answer: a
        )
        for answer in (COMMIT, ROLLBACK, UNKNOWN)
    }
    assert {a: (r.answer, r.resolved) for a, r in results.items()} == {
        COMMIT: (COMMIT, True),
        ROLLBACK: (ROLLBACK, True),
        UNKNOWN: (UNKNOWN, False),
    }
    as_text = prepared.send_in_transaction(Message("orders", {}), lambda _: "Commit")
    assert (as_text.answer, as_text.resolved) == (COMMIT, True)
    assert status_of(engine, results[COMMIT].message_id) == "pending"
    assert status_of(engine, results[ROLLBACK].message_id) == "rolled_back"
    assert status_of(engine, results[UNKNOWN].message_id) == "prepared"
    assert row(engine, results[UNKNOWN].message_id)["check_group"] == "shop"

    # An exception counts as UNKNOWN: the message stays prepared for check-back, and the
    # exception reaches the caller. So does an answer that is none of the three.
    seen: list[uuid.UUID] = []

    def payment_timed_out(message_id: uuid.UUID) -> str:
        seen.append(message_id)
        raise TimeoutError("the provider did not answer; it may have taken the money")

    with pytest.raises(TimeoutError):
        prepared.send_in_transaction(Message("orders", {"n": 1}), payment_timed_out)
    with pytest.raises(InvalidAnswer):
        prepared.send_in_transaction(Message("orders", {"n": 2}), lambda _: True)  # type: ignore[arg-type,return-value]
    assert status_of(engine, seen[0]) == "prepared"
    with engine.connect() as conn:
        waiting = conn.execute(sa.text("SELECT count(*) FROM outbox WHERE status = 'prepared'"))
        assert waiting.scalar_one() == 3  # UNKNOWN, the exception, the bad answer


def test_an_idempotency_key_prepares_once(engine) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine))
    first = prepared.prepare("orders", {"n": 1}, idempotency_key="order-7-created")
    again = prepared.prepare("orders", {"n": 1}, idempotency_key="order-7-created")
    assert again.duplicate and again.message_id == first.message_id
    again.commit()
    assert status_of(engine, first.message_id) == "pending"


def test_a_rolled_back_message_gives_its_idempotency_key_up(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    ob = Outbox(engine)
    prepared = PreparedMessages(ob, check_after=0)
    # Rolled back by its producer: a plain publish with the key afterwards is a new message.
    first = prepared.prepare("orders", {"order": 7}, idempotency_key="order-7-created")
    first.rollback()
    with ob.transaction() as tx:
        retried = tx.publish("orders", {"order": 7}, idempotency_key="order-7-created")
    assert retried.message_id != first.message_id
    assert status_of(engine, retried.message_id) == "pending"
    assert row(engine, first.message_id)["idempotency_key"] is None
    # Rolled back by check-back at max checks (its last check blocked the step): the key is
    # free again too.
    given_up = prepared.prepare("orders", {"order": 8}, idempotency_key="order-8-created")
    registry = CheckRegistry()
    registry.add_checker(lambda message: ROLLBACK if message.final else UNKNOWN, "orders")
    with running_checkback(
        registry, fast_config(outbox_url, max_checks=1, on_max_checks="rollback")
    ):
        wait_for(lambda: status_of(engine, given_up.message_id) == "rolled_back", 30, "expiry")
    again = prepared.prepare("orders", {"order": 8}, idempotency_key="order-8-created")
    assert not again.duplicate and again.message_id != given_up.message_id


def test_send_in_transaction_runs_the_step_once_per_idempotency_key(engine) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine))
    steps: list[uuid.UUID] = []

    def step(answer: str) -> Callable[[uuid.UUID], str]:
        return lambda message_id: steps.append(message_id) or answer  # type: ignore[func-returns-value]

    declined = prepared.send_in_transaction(
        Message("orders", {"n": 8}, idempotency_key="order-8"), step(ROLLBACK)
    )
    # A retry after a rollback runs the step again, as a new message, and commits it.
    retried = prepared.send_in_transaction(
        Message("orders", {"n": 8}, idempotency_key="order-8"), step(COMMIT)
    )
    assert (retried.answer, retried.resolved, retried.duplicate) == (COMMIT, True, False)
    assert retried.message_id != declined.message_id
    assert status_of(engine, retried.message_id) == "pending"
    assert steps == [declined.message_id, retried.message_id]
    # Once the key is committed (or is a plain message's), the step does not run again.
    again = prepared.send_in_transaction(
        Message("orders", {"n": 8}, idempotency_key="order-8"), step(COMMIT)
    )
    assert (again.message_id, again.answer, again.resolved, again.duplicate) == (
        retried.message_id,
        COMMIT,
        True,
        True,
    )
    with Outbox(engine).transaction() as tx:
        plain = tx.publish("orders", {"n": 9}, idempotency_key="order-9").message_id
    after_plain = prepared.send_in_transaction(
        Message("orders", {"n": 9}, idempotency_key="order-9"), step(ROLLBACK)
    )
    assert (after_plain.message_id, after_plain.answer, after_plain.duplicate) == (
        plain,
        COMMIT,
        True,
    )
    # While the key's message waits for a verdict, it says so and runs nothing either.
    waiting = prepared.prepare("orders", {"n": 10}, idempotency_key="order-10")
    undecided = prepared.send_in_transaction(
        Message("orders", {"n": 10}, idempotency_key="order-10"), step(COMMIT)
    )
    assert (undecided.message_id, undecided.answer, undecided.resolved) == (
        waiting.message_id,
        UNKNOWN,
        False,
    )
    assert steps == [declined.message_id, retried.message_id]
    assert status_of(engine, waiting.message_id) == "prepared"


@pytest.mark.asyncio
async def test_the_asyncio_api(outbox_url: str, engine: sa.Engine) -> None:
    prepared = PreparedMessages(Outbox(outbox_url))
    try:
        message = await prepared.aprepare("orders", {"n": 1}, key=1)
        await message.acommit()

        async def create_order(message_id: uuid.UUID) -> str:
            return ROLLBACK

        result = await prepared.asend_in_transaction(Message("orders", {"n": 2}), create_order)
        plain = await prepared.asend_in_transaction(Message("orders", {"n": 3}), lambda _: COMMIT)
        assert (result.answer, result.resolved) == (ROLLBACK, True)
        assert status_of(engine, message.message_id) == "pending"
        assert status_of(engine, result.message_id) == "rolled_back"
        assert status_of(engine, plain.message_id) == "pending"
        ran: list[uuid.UUID] = []

        async def step(message_id: uuid.UUID) -> str:
            ran.append(message_id)
            return COMMIT

        keyed = Message("orders", {"n": 4}, idempotency_key="order-4")
        first = await prepared.asend_in_transaction(keyed, step)
        again = await prepared.asend_in_transaction(keyed, step)
        assert (again.message_id, again.answer, again.duplicate) == (first.message_id, COMMIT, True)
        assert ran == [first.message_id]
    finally:
        await prepared.outbox.async_engine.dispose()


# -- order ------------------------------------------------------------------------------------


def test_a_committed_message_takes_its_place_in_key_order_at_commit(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    """Later messages of the key do not wait for a prepared one: it is sent after every
    message of its key committed before its own commit, and before those committed after."""
    topic = make_topic("prep-order")
    ob = Outbox(engine)
    prepared = PreparedMessages(ob)

    def plain(n: int) -> uuid.UUID:
        with ob.transaction() as tx:
            return tx.publish(topic, {"n": n}, key="order-7").message_id

    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        first = plain(1)
        half = prepared.prepare(topic, {"n": "prepared"}, key="order-7")
        dropped = prepared.prepare(topic, {"n": "rolled back"}, key="order-7")
        second, third = plain(2), plain(3)
        # Sent while the prepared messages wait: they hold nothing back.
        wait_for(lambda: status_of(engine, third) == "sent", 30, "later messages sent")
        half.commit()
        dropped.rollback()
        fourth = plain(4)
        wait_for(lambda: status_of(engine, fourth) == "sent", 30, "all sent")
    assert published(bootstrap_servers, topic, expect=5) == [
        first,
        second,
        third,
        half.message_id,
        fourth,
    ]
    assert row(engine, half.message_id)["seq"] > row(engine, third)["seq"]


def test_the_immediate_sender_is_not_held_back_by_a_prepared_message(
    engine, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("prep-imm")
    half = PreparedMessages(Outbox(engine)).prepare(topic, {"n": 0}, key="k")
    sender = ImmediateSender(engine, {"bootstrap.servers": bootstrap_servers})
    try:
        with Outbox(engine, immediate=sender).transaction() as tx:
            later = tx.publish(topic, {"n": 1}, key="k").message_id
        assert sender.flush(30)
    finally:
        sender.close(10)
    # No relay runs: only the sender can have sent it, so it was not released behind the
    # earlier prepared row of its key.
    assert status_of(engine, later) == "sent"
    assert status_of(engine, half.message_id) == "prepared"
    assert published(bootstrap_servers, topic, expect=1) == [later]


# -- check-back -------------------------------------------------------------------------------


def start_writer(
    outbox_url: str, orders_url: str, topic: str, order: int, mode: str
) -> tuple[subprocess.Popen[str], uuid.UUID]:
    """The order service in a process of its own, stopped between prepare and commit."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.prepared_app",
            outbox_url,
            orders_url,
            topic,
            str(order),
            mode,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline() if process.stdout else ""
    assert line.startswith("prepared "), line
    return process, uuid.UUID(line.split()[1])


def start_checkback_process(outbox_url: str, orders_url: str, *args: str) -> RelayProcess:
    port = free_port()
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": outbox_url,
        "ORDERS_DATABASE_URL": orders_url,
        "OUTBOX_CHECKBACK_POLL_INTERVAL": "0.1",
        "OUTBOX_CHECKBACK_CHECK_INTERVAL": "0.2",
        "OUTBOX_CHECKBACK_BACKOFF_MAX": "0.5",
        "OUTBOX_CHECKBACK_METRICS_PORT": str(port),
    }
    process = RelayProcess(
        [sys.executable, "-m", "outbox.cli", "checkback", "tests.prepared_app:registry", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    process.metrics_port = port
    STARTED.append(process)
    process.wait_ready()
    return process


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_writer_killed_between_prepare_and_commit_is_decided_by_check_back(
    engine, outbox_url, orders_url, orders, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    """The seeds' order flow, the orders in a second database: the writer dies (-9) after
    preparing, with or without the order written; `outbox checkback` asks the order service's
    checker, which commits the one whose order exists and rolls back the other."""
    topic = make_topic("prep-kill")
    with_order, placed = start_writer(outbox_url, orders_url, topic, 7, "with-order")
    without_order, lost = start_writer(outbox_url, orders_url, topic, 8, "without-order")
    for writer in (with_order, without_order):
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
        if writer.stdout is not None:
            writer.stdout.close()
    assert prepared_app.order_exists(orders, 7) and not prepared_app.order_exists(orders, 8)
    assert status_of(engine, placed) == status_of(engine, lost) == "prepared"

    checkback = start_checkback_process(outbox_url, orders_url)
    try:
        with running_relay(relay_config(outbox_url, bootstrap_servers)):
            wait_for(lambda: status_of(engine, placed) == "sent", 30, "the order's message sent")
            wait_for(lambda: status_of(engine, lost) == "rolled_back", 30, "the other rolled back")
        status, metrics = http_get(checkback.metrics_port, "/metrics")
        assert status == 200
        assert (
            'outbox_checkback_resolved_total{answer="commit",group="order-service"} 1.0' in metrics
        )
        assert (
            'outbox_checkback_resolved_total{answer="rollback",group="order-service"} 1.0'
            in metrics
        )
        assert http_get(checkback.metrics_port, "/healthz")[0] == 200
    finally:
        assert stop_process(checkback) == 0
    assert published(bootstrap_servers, topic, expect=1) == [placed]
    for message, answer in ((placed, "commit"), (lost, "rollback")):
        stored = row(engine, message)
        assert (stored["resolved_by"], stored["last_check_answer"]) == ("check", answer)
        assert stored["check_count"] >= 1 and stored["last_checked_at"] is not None
        assert stored["check_group"] == prepared_app.GROUP


def test_unknown_then_commit_and_a_checker_that_raises_are_checked_again(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    later = prepared.prepare("orders", {"n": 1}, group="later")
    flaky = prepared.prepare("orders", {"n": 2}, group="flaky")
    failures = iter(["orders database unreachable", "still unreachable"])
    recovered = threading.Event()

    def unreachable_then_there(message: CheckMessage) -> str:
        reason = next(failures, None)
        if reason is not None:
            raise ConnectionError(reason)
        recovered.wait(10)  # the test looks at the row between the failures and the answer
        return COMMIT

    registry = CheckRegistry()
    registry.add_checker(answers(UNKNOWN, UNKNOWN, COMMIT), "later")
    registry.add_checker(unreachable_then_there, "flaky")
    with running_checkback(registry, fast_config(outbox_url, check_timeout=15)) as runner:
        wait_for(lambda: row(engine, flaky.message_id)["check_count"] == 2, 20, "two failures")
        failed = row(engine, flaky.message_id)
        recovered.set()
        wait_for(lambda: status_of(engine, later.message_id) == "pending", 20, "later committed")
        wait_for(lambda: status_of(engine, flaky.message_id) == "pending", 20, "flaky committed")
    assert (failed["status"], failed["last_check_answer"]) == ("prepared", "error")
    assert failed["last_check_error"] == "ConnectionError: still unreachable"
    assert failed["next_check_at"] > failed["last_checked_at"]
    for message in (later, flaky):
        stored = row(engine, message.message_id)
        assert (stored["check_count"], stored["last_check_answer"]) == (3, "commit")
        assert stored["last_check_error"] is None and stored["resolved_by"] == "check"
    assert counter(runner, "checks", "later", "unknown") == 2
    assert counter(runner, "checks", "flaky", "error") == 2
    assert counter(runner, "resolved", "later", "commit") == 1
    assert counter(runner, "resolved", "flaky", "commit") == 1


def test_a_hung_checker_costs_its_check_not_the_runner(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    stuck = prepared.prepare("orders", {"n": 1}, group="hangs")
    release = threading.Event()

    def hangs_until_released(message: CheckMessage) -> str:
        release.wait(60)
        return ROLLBACK

    registry = CheckRegistry()
    registry.add_checker(hangs_until_released, "hangs")
    registry.add_checker(answers(COMMIT), "answers")
    config = fast_config(outbox_url, check_timeout=0.5, max_hung_checks=2, metrics_port=0)
    try:
        with running_checkback(registry, config) as runner:
            wait_for(lambda: row(engine, stuck.message_id)["check_count"] >= 2, 20, "2 timeouts")
            # Meanwhile other messages are checked and decided.
            quick = prepared.prepare("orders", {"n": 2}, group="answers")
            wait_for(lambda: status_of(engine, quick.message_id) == "pending", 20, "checked")
            stored = row(engine, stuck.message_id)
            assert (stored["status"], stored["last_check_answer"]) == ("prepared", "timeout")
            assert stored["last_check_error"] == "no answer within 0.5s"
            assert counter(runner, "checks", "hangs", "timeout") >= 2
            # Checker threads that never return pile up; the runner then reports unhealthy,
            # so that a supervisor restarts it.
            assert runner.metrics_address is not None
            port = runner.metrics_address[1]
            wait_for(lambda: http_get(port, "/healthz")[0] == 503, 20, "unhealthy")
            assert "checks hung" in http_get(port, "/healthz")[1]
            release.set()
            wait_for(lambda: status_of(engine, stuck.message_id) == "rolled_back", 20, "decided")
            wait_for(lambda: http_get(port, "/healthz")[0] == 200, 20, "healthy again")
    finally:
        release.set()


def test_a_checker_error_the_database_refuses_as_text_costs_no_other_verdict(
    engine, outbox_url
) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), group="g", check_after=0)
    innocent = prepared.prepare("orders", {"n": 1})
    bad = prepared.prepare("orders", {"n": "bad"})
    with engine.begin() as conn:  # prepared an hour ago, by the database's clock
        conn.execute(sa.text("UPDATE outbox SET prepared_at = now() - interval '1 hour'"))
    ages: list[float] = []

    def check(message: CheckMessage) -> str:
        ages.append(message.age.total_seconds())
        if message.value["n"] == "bad":
            raise ValueError("provider said b'\x00\x01' via postgresql://pay:hunter2@bank/x")
        return COMMIT

    registry = CheckRegistry()
    registry.add_checker(check, "g")
    with running_checkback(registry, fast_config(outbox_url, concurrency=2, max_checks=100)):
        wait_for(lambda: row(engine, bad.message_id)["check_count"] >= 1, 30, "the bad check")
    assert status_of(engine, innocent.message_id) == "pending"
    error = row(engine, bad.message_id)["last_check_error"]
    assert "\\x00" in error and "\x00" not in error and "hunter2" not in error
    assert all(3590 < age < 3700 for age in ages), ages


@pytest.mark.parametrize(("mode", "end"), [("rollback", "rolled_back"), ("dead", "dead")])
def test_max_checks_ends_a_message_as_configured(
    engine, outbox_url, bootstrap_servers, make_topic, mode: str, end: str
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("prep-max")
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    message = prepared.prepare(topic, {"n": 1}, group="never-sure")
    registry = CheckRegistry()
    # UNKNOWN, unless the check must decide (the last one under --on-max-checks rollback):
    # then it blocks the step, as StepLog does, and answers ROLLBACK.
    registry.add_checker(lambda m: ROLLBACK if m.final else UNKNOWN, "never-sure")
    config = fast_config(outbox_url, max_checks=3, on_max_checks=mode)
    with running_checkback(registry, config) as runner:
        wait_for(lambda: status_of(engine, message.message_id) == end, 20, f"{end} after 3")
    stored = row(engine, message.message_id)
    assert stored["check_count"] == 3
    assert counter(runner, "expired", "never-sure", end) == 1
    if mode == "rollback":
        assert (stored["resolved_by"], stored["last_check_answer"]) == ("expired", "rollback")
        assert stored["error_kind"] is None
        assert counter(runner, "checks", "never-sure", "unknown") == 2
        return
    assert stored["error_kind"] == "unresolved"
    assert stored["last_error"] == "no verdict after 3 checks (0 failed; last answer: unknown)"
    assert counter(runner, "checks", "never-sure", "unknown") == 3
    # Dead for an operator: `outbox dead retry` leaves it alone (nobody knows whether its
    # step happened); `outbox prepared` lists it, and commit publishes it.
    url = ["--database-url", outbox_url]
    retried = CliRunner().invoke(main, ["dead", "retry", "--all", *url])
    assert retried.output.strip() == "requeued 0 dead message(s)"
    listed = CliRunner().invoke(main, ["prepared", "list", *url])
    assert str(message.message_id) in listed.output and " dead " in listed.output
    committed = CliRunner().invoke(main, ["prepared", "commit", str(message.message_id), *url])
    assert committed.output.strip() == "committed 1 prepared message(s)", committed.output
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: status_of(engine, message.message_id) == "sent", 30, "sent")
    assert row(engine, message.message_id)["resolved_by"] == "operator"
    assert published(bootstrap_servers, topic, expect=1) == [message.message_id]


def test_several_runners_check_each_message_once(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), group="shared", check_after=0)
    ids = {prepared.prepare("orders", {"n": n}).message_id for n in range(40)}
    checked: list[uuid.UUID] = []
    lock = threading.Lock()

    def slow_commit(message: CheckMessage) -> str:
        with lock:
            checked.append(message.id)
        threading.Event().wait(0.05)
        return COMMIT

    registry = CheckRegistry()
    registry.add_checker(slow_commit, "shared")
    config = fast_config(outbox_url, concurrency=3)

    def all_pending() -> bool:
        with engine.connect() as conn:
            found = conn.execute(sa.text("SELECT count(*) FROM outbox WHERE status = 'pending'"))
            return bool(found.scalar_one() == 40)

    with (
        running_checkback(registry, config) as a,
        running_checkback(registry, config) as b,
        running_checkback(registry, config) as c,
    ):
        wait_for(all_pending, 30, "all committed")
    assert sorted(checked) == sorted(ids)  # each once
    shares = [counter(r, "resolved", "shared", "commit") for r in (a, b, c)]
    assert sum(shares) == 40 and sum(1 for share in shares if share) >= 2


def test_a_runner_ignores_groups_it_has_no_checker_for(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    other = prepared.prepare("payments", {"n": 1})  # checked by the payment service's runner
    mine = prepared.prepare("orders", {"n": 1})
    registry = CheckRegistry()
    registry.add_checker(answers(COMMIT), "orders")
    with running_checkback(registry, fast_config(outbox_url)) as runner:
        wait_for(lambda: status_of(engine, mine.message_id) == "pending", 20, "checked")
        wait_for(lambda: runner.metrics.prepared.labels("orders")._value.get() == 0, 20, "count")
    assert status_of(engine, other.message_id) == "prepared"
    assert row(engine, other.message_id)["check_count"] == 0


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_relay_restarts_during_check_back_lose_nothing_and_publish_no_rollback(
    engine, outbox_url, bootstrap_servers, make_topic, tmp_path, mode: str
) -> None:  # type: ignore[no-untyped-def]
    """Prepared messages decided by check-back while relays are killed (-9) and restarted:
    every committed message reaches the topic, no rolled-back one ever does, and in
    exactly-once mode a read_committed consumer sees each committed message once."""
    topic = make_topic("prep-relay", partitions=3)
    ob = Outbox(engine)
    prepared = PreparedMessages(ob, group="orders", check_after=0)
    verdicts = {}
    for n in range(60):
        message = prepared.prepare(topic, {"n": n}, key=f"order-{n % 6}")
        verdicts[message.message_id] = COMMIT if n % 3 else ROLLBACK
    with ob.transaction() as tx:
        plain = [
            tx.publish(topic, {"plain": n}, key=f"order-{n % 6}").message_id for n in range(30)
        ]

    def decide(message: CheckMessage) -> str:
        threading.Event().wait(0.02)
        return verdicts[message.id] if message.checks else UNKNOWN

    registry = CheckRegistry()
    registry.add_checker(decide, "orders")
    prefix = f"prep-{uuid.uuid4().hex[:8]}"
    args = ("--mode", mode, "--transactional-id-prefix", prefix, "--progress-topic", f"p-{prefix}")
    log = tmp_path / "relay.log"
    relay = start_relay_process(outbox_url, bootstrap_servers, *args, log=log)
    with running_checkback(registry, fast_config(outbox_url, concurrency=2)):

        def decided() -> int:
            with engine.connect() as conn:
                found = conn.execute(
                    sa.text("SELECT count(*) FROM outbox WHERE status <> 'prepared'")
                )
                return int(found.scalar_one())

        wait_for(lambda: decided() >= 50, 60, "some decided")
        relay.send_signal(signal.SIGKILL)
        relay.wait(10)
        relay = start_relay_process(outbox_url, bootstrap_servers, *args, log=log)
        wait_for(lambda: decided() == 90, 60, "all decided")
    committed = {m for m, v in verdicts.items() if v == COMMIT} | set(plain)
    rolled_back = {m for m, v in verdicts.items() if v == ROLLBACK}
    try:
        with engine.connect() as conn:
            wait_for(
                lambda: (
                    conn.execute(
                        sa.text("SELECT count(*) FROM outbox WHERE status = 'sent'")
                    ).scalar_one()
                    == len(committed)
                ),
                60,
                "every committed message sent",
            )
    finally:
        assert stop_process(relay) == 0
    records = published(bootstrap_servers, topic, expect=len(committed), timeout=60)
    assert set(records) == committed  # nothing lost, nothing rolled back published
    assert not set(records) & rolled_back
    if mode == "exactly-once":
        assert len(records) == len(committed)
    with engine.connect() as conn:
        states = dict(
            conn.execute(sa.text("SELECT status, count(*) FROM outbox GROUP BY status")).all()
        )
    assert states == {"sent": len(committed), "rolled_back": len(rolled_back)}


# -- the operator's commands ------------------------------------------------------------------


def test_outbox_prepared_list_show_commit_and_rollback(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    prepared = PreparedMessages(Outbox(engine), group="ops")
    first, second, third = (prepared.prepare("orders", {"n": n}, key=n) for n in range(3))
    url = ["--database-url", outbox_url]

    def cli(*args: str) -> str:
        result = CliRunner().invoke(main, [*args, *url])
        assert result.exit_code == 0, result.output
        return result.output

    listed = cli("prepared", "list", "--group", "ops")
    assert listed.splitlines()[-1] == "3 message(s) waiting for a verdict"
    assert listed.index(str(first.message_id)) < listed.index(str(third.message_id))
    shown = cli("prepared", "show", str(first.message_id))
    assert "check_group  ops" in shown and "status  prepared" in shown
    assert cli("prepared", "commit", str(first.message_id)) == "committed 1 prepared message(s)\n"
    again = CliRunner().invoke(main, ["prepared", "rollback", str(first.message_id), *url])
    assert again.exit_code == 1  # it changed nothing
    assert again.output.splitlines() == [
        "rolled back 0 prepared message(s)",
        "1 of the ids given were not waiting for a verdict (see outbox prepared show ID)",
    ]
    # Their steps may still commit: refused, unless the operator says they cannot.
    unsure = CliRunner().invoke(main, ["prepared", "rollback", "--group", "ops", *url])
    assert unsure.exit_code == 2 and "its step may still commit" in unsure.output
    assert status_of(engine, second.message_id) == "prepared"
    forced = cli("prepared", "rollback", "--step-cannot-happen", "--group", "ops")
    assert forced == "rolled back 2 prepared message(s)\n"
    assert [status_of(engine, p.message_id) for p in (first, second, third)] == [
        "pending",
        "rolled_back",
        "rolled_back",
    ]
    assert row(engine, second.message_id)["resolved_by"] == "operator"
    refused = CliRunner().invoke(main, ["prepared", "commit", *url])
    assert refused.exit_code == 2 and "name message ids" in refused.output


def test_checkback_refuses_a_table_without_revision_0004(database_url: str) -> None:
    from outbox import migrate

    migrate.upgrade(database_url, revision="0003_wake_trigger")
    result = subprocess.run(
        [sys.executable, "-m", "outbox.cli", "checkback", "tests.prepared_app:registry",
         "--database-url", database_url, "--log-format", "text"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "Error: table public.outbox predates prepared messages (revision 0004_prepared_messages):"
        " run `outbox db upgrade`"
    ]
    engine = sa.create_engine(database_url)
    try:
        with pytest.raises(OutboxError, match="predates prepared messages"):
            PreparedMessages(Outbox(engine)).prepare("orders", {})
    finally:
        engine.dispose()


#: The grants docs/prepared-messages.md gives a service that prepares messages.
SERVICE_GRANTS = """
GRANT USAGE ON SCHEMA public TO {role};
GRANT INSERT ON public.outbox TO {role};
GRANT SELECT (id, idempotency_key, status, error_kind, prepared_at, resolved_by, deliver_at,
               released_idempotency_key)
   ON public.outbox TO {role};
GRANT UPDATE (status, seq, created_at, resolved_at, resolved_by, next_check_at, lease_owner,
              lease_until, attempts, next_attempt_at, error_kind, last_error,
              idempotency_key, released_idempotency_key)
   ON public.outbox TO {role};
"""
#: ... and its check-back runner.
RUNNER_GRANTS = """
GRANT USAGE ON SCHEMA public TO {role};
GRANT SELECT, UPDATE ON public.outbox TO {role};
"""


def test_the_documented_grants_are_enough(engine, login_role) -> None:  # type: ignore[no-untyped-def]
    urls = {
        kind: login_role(grants, prefix=f"prep_{kind}")
        for kind, grants in (("service", SERVICE_GRANTS), ("runner", RUNNER_GRANTS))
    }
    service = sa.create_engine(urls["service"])
    try:
        prepared = PreparedMessages(Outbox(service), check_after=0)
        kept = prepared.prepare("orders", {"n": 1}, idempotency_key="order-1")
        assert prepared.prepare("orders", {"n": 1}, idempotency_key="order-1").duplicate
        kept.commit()
        kept.commit()
        dropped = prepared.prepare("orders", {"n": 2}, idempotency_key="order-2")
        dropped.rollback()
        with pytest.raises(NotPrepared):
            dropped.commit()
        with pytest.raises(NotPrepared, match="rolled back by its producer"):
            prepared.commit(dropped.message_id, after_rollback=True)
        left = prepared.prepare("orders", {"n": 3})
        undone = prepared.prepare("orders", {"n": 5}, idempotency_key="order-5", group="undone")
    finally:
        service.dispose()
    # Without UPDATE, the decision fails for good: a typed error, not "left to check-back".
    insert_only_grants = SERVICE_GRANTS.split("GRANT UPDATE")[0]
    insert_only = sa.create_engine(login_role(insert_only_grants, prefix="prep_insert_only"))
    try:
        with pytest.raises(PermissionDenied):
            PreparedMessages(Outbox(insert_only)).send_in_transaction(
                Message("orders", {"n": 4}), lambda _: COMMIT
            )
    finally:
        insert_only.dispose()
    registry = CheckRegistry()
    registry.add_checker(answers(COMMIT), "orders")
    registry.add_checker(answers(ROLLBACK), "undone")
    config = fast_config(urls["runner"])
    with running_checkback(registry, config):
        wait_for(lambda: status_of(engine, left.message_id) == "pending", 20, "checked")
        wait_for(lambda: status_of(engine, undone.message_id) == "rolled_back", 20, "checked")
    assert status_of(engine, kept.message_id) == "pending"
    assert status_of(engine, dropped.message_id) == "rolled_back"
    # The step happened after all: the service commits it after the rollback, key and all.
    service = sa.create_engine(urls["service"])
    try:
        PreparedMessages(Outbox(service)).commit(undone.message_id, after_rollback=True)
    finally:
        service.dispose()
    assert row(engine, undone.message_id)["idempotency_key"] == "order-5"
