"""Prepared messages without servers: answers, the checker registry, checker calls bounded by
a timeout, the runner's settings and backoff, and the runner's round on a stub store."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import InvalidAnswer, InvalidKey, Message, NotPrepared, Outbox
from outbox.errors import ConfigError
from outbox.prepared import (
    COMMIT,
    ROLLBACK,
    UNKNOWN,
    Answer,
    CheckbackConfig,
    CheckbackRunner,
    CheckMessage,
    CheckRegistry,
    PreparedMessages,
    load_registry,
)
from outbox.prepared.answers import parse_answer
from outbox.prepared.api import already_decided
from outbox.prepared.calls import ERROR, TIMEOUT, CheckCalls
from outbox.prepared.store import CheckRecord, Recorded

NOWHERE = "postgresql+psycopg://app@127.0.0.1:1/shop"  # never connected to


def claimed_row(group: str = "orders", value: bytes | None = b'{"order_id": 7}', **extra: Any):  # type: ignore[no-untyped-def]
    row = {
        "id": uuid.uuid4(),
        "topic": "orders",
        "key": b"7",
        "value": value,
        "content_type": "application/json",
        "header_names": ["trace"],
        "header_values": [b"abc"],
        "check_group": group,
        "check_count": 0,
        "prepared_at": datetime.now(UTC) - timedelta(seconds=30),
    }
    row.update(extra)
    return row


def message(group: str = "orders", **extra: Any) -> CheckMessage:
    return CheckRegistry().message(claimed_row(group, **extra))


# -- answers ----------------------------------------------------------------------------------


def test_answers_are_the_three_states_also_as_text() -> None:
    assert parse_answer(COMMIT, "x") is Answer.COMMIT
    assert parse_answer("Rollback", "x") is ROLLBACK
    assert parse_answer("unknown", "x") is UNKNOWN
    for bad in (None, True, "yes", 1):
        with pytest.raises(InvalidAnswer, match="the checker must answer COMMIT, ROLLBACK or"):
            parse_answer(bad, "the checker")


def test_a_decision_that_changed_nothing_is_fine_only_when_it_was_the_same() -> None:
    mid = uuid.uuid4()

    def status(status: str, error_kind: str | None = None) -> dict[str, Any]:
        return {
            "id": mid,
            "status": status,
            "error_kind": error_kind,
            "prepared_at": datetime.now(UTC),
            "resolved_by": "check",
        }

    already_decided(mid, status("sent"), COMMIT)
    already_decided(mid, status("dead", "MSG_SIZE_TOO_LARGE"), COMMIT)  # committed, then died
    already_decided(mid, status("rolled_back"), ROLLBACK)
    with pytest.raises(NotPrepared, match=r"already committed \(by check\).*on its topic"):
        already_decided(mid, status("pending"), ROLLBACK)
    with pytest.raises(NotPrepared, match="already rolled back") as refused:
        already_decided(mid, status("rolled_back"), COMMIT)
    assert (refused.value.message_id, refused.value.status) == (mid, "rolled_back")
    with pytest.raises(NotPrepared, match="no prepared message"):
        already_decided(mid, None, COMMIT)
    with pytest.raises(NotPrepared, match="no prepared message"):  # a plain message
        already_decided(mid, {**status("pending"), "prepared_at": None}, COMMIT)


def test_bad_input_is_refused_before_the_database_is_reached() -> None:
    prepared = PreparedMessages(Outbox(NOWHERE))
    with pytest.raises(InvalidKey):
        prepared.prepare("orders", {}, key=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="check group"):
        prepared.prepare("orders", {}, group="\x00")
    with pytest.raises(ConfigError, match="check_after"):
        prepared.prepare("orders", {}, check_after=timedelta(seconds=-1))
    with pytest.raises(ConfigError, match="message id"):
        prepared.commit("not-a-uuid")
    with pytest.raises(ConfigError, match="asend_in_transaction"):

        async def local(message_id: uuid.UUID) -> str:
            return COMMIT

        prepared.send_in_transaction(Message("orders", {}), local)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        PreparedMessages("not an outbox")  # type: ignore[arg-type]


# -- the registry -----------------------------------------------------------------------------


def test_the_registry_holds_one_checker_per_group() -> None:
    registry = CheckRegistry()

    @registry.checker("orders", "refunds")
    def check(message: CheckMessage) -> Answer:
        return COMMIT

    assert registry.groups == ["orders", "refunds"]
    with pytest.raises(ConfigError, match="already has a checker"):
        registry.add_checker(check, "orders")
    with pytest.raises(ConfigError, match="at least one"):
        registry.add_checker(check)
    with pytest.raises(ConfigError, match="callable"):
        registry.add_checker("check", "payments")  # type: ignore[arg-type]
    for bad in ("", " ", "x" * 201, "tab\there"):
        with pytest.raises(ConfigError):
            registry.add_checker(check, bad)
    assert registry.groups == ["orders", "refunds"]  # nothing half-registered


def test_a_checker_gets_the_message_decoded() -> None:
    got = message()
    assert got.value == {"order_id": 7} and got.raw_value == b'{"order_id": 7}'
    assert got.key == b"7" and got.header("trace") == b"abc" and got.header("none") is None
    assert got.group == "orders" and got.checks == 0
    assert timedelta(seconds=29) < got.age < timedelta(minutes=1)
    # A value the deserializer cannot read is passed as it is.
    assert message(value=b"{not json").value == b"{not json"


def test_load_registry_names_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match="module:attribute"):
        load_registry("tests.prepared_app")
    with pytest.raises(ConfigError, match="cannot import"):
        load_registry("tests.no_such_module:registry")
    with pytest.raises(ConfigError, match=r"is not an outbox\.prepared\.CheckRegistry"):
        load_registry("tests.prepared_app:GROUP")
    assert load_registry("tests.prepared_app:registry").groups == ["order-service"]


# -- checker calls ----------------------------------------------------------------------------


def test_checker_calls_run_at_once_and_a_hung_one_times_out() -> None:
    release = threading.Event()

    def hangs(message: CheckMessage) -> str:
        release.wait(30)
        return COMMIT

    def raises(message: CheckMessage) -> str:
        raise RuntimeError("payment provider down")

    async def answers_async(message: CheckMessage) -> str:
        return "rollback"

    checkers = {
        "hangs": hangs,
        "raises": raises,
        "async": answers_async,
        "bad": lambda m: 42,
        "slow": lambda m: time.sleep(0.2) or UNKNOWN,
    }
    calls = CheckCalls(checkers.__getitem__, timeout=0.5)
    messages = [message(group) for group in ("hangs", "raises", "async", "bad", "slow", "slow")]
    started = time.monotonic()
    outcomes = calls.run(messages)
    took = time.monotonic() - started
    try:
        assert [(o.message.group, o.answer) for o in outcomes] == [
            ("hangs", TIMEOUT),
            ("raises", ERROR),
            ("async", "rollback"),
            ("bad", ERROR),
            ("slow", "unknown"),
            ("slow", "unknown"),
        ]
        assert outcomes[0].error == "no answer within 0.5s"
        assert outcomes[1].error == "RuntimeError: payment provider down"
        assert "must answer COMMIT, ROLLBACK or UNKNOWN, not 42" in (outcomes[3].error or "")
        assert 0.5 <= took < 1.5  # at once: the hung one bounds the round, not the sum
        assert calls.hung == 1
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while calls.hung and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls.hung == 0


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"check_timeout": 0},
        {"concurrency": 0},
        {"poll_interval": 0},
        {"check_interval": 10, "backoff_max": 5},
        {"max_checks": 0},
        {"on_max_checks": "ignore"},
        {"max_hung_checks": 0},
        {"metrics_port": 70000},
        {"check_timeout": 1e13},
        {"check_interval": 1e13, "backoff_max": 1e13},
        {"backoff_max": 1e15},
        {"poll_interval": float("nan")},
    ],
)
def test_bad_runner_settings_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        CheckbackConfig(database_url=NOWHERE, **bad)


def test_checks_back_off_doubling_up_to_the_maximum() -> None:
    config = CheckbackConfig(database_url=NOWHERE, check_interval=60, backoff_max=600)
    assert config.max_checks == 15 and config.end_status == "dead"
    for checks, ceiling in ((1, 60), (2, 120), (3, 240), (4, 480), (5, 600), (14, 600)):
        delays = [config.delay_after(checks) for _ in range(50)]
        assert all(ceiling / 2 <= delay <= ceiling for delay in delays), checks
    assert CheckbackConfig(database_url=NOWHERE, on_max_checks="dead").end_status == "dead"
    assert config.lease_seconds > config.check_timeout


# -- the runner on a stub store ---------------------------------------------------------------


class StubStore:
    """Due rows handed out once; what the runner records is kept."""

    def __init__(self, rows: list[dict[str, Any]], fail_claims: int = 0) -> None:
        self.rows = rows
        self.fail_claims = fail_claims
        self.recorded: list[tuple[str, list[CheckRecord], int]] = []

    def claim_due(self, engine: Any, owner: str, groups: Any, limit: int, lease: float) -> Any:
        if self.fail_claims:
            self.fail_claims -= 1
            raise sa.exc.OperationalError("SELECT", {}, Exception("server closed the connection"))
        taken, self.rows = self.rows[:limit], self.rows[limit:]
        return [row for row in taken if row["check_group"] in groups]

    def record_checks(
        self, engine: Any, owner: str, checks: list[CheckRecord], max_checks: int
    ) -> Recorded:
        self.recorded.append((owner, list(checks), max_checks))
        ids = frozenset(c.id for c in checks)
        return Recorded(
            ids,
            tuple(c.id for c in checks if c.answer == "commit"),
            tuple(c.id for c in checks if c.answer == "rollback"),
            tuple((c.id, "dead") for c in checks if c.answer not in ("commit", "rollback")),
        )

    def counts(self, engine: Any, groups: Any) -> dict[str, tuple[int, float]]:
        return {"orders": (len(self.rows), 12.5)}

    def problem(self, engine: Any) -> None:
        return None


ENGINE = sa.create_engine(NOWHERE)


def stub_runner(store: StubStore, **config: Any) -> CheckbackRunner:
    registry = CheckRegistry()
    registry.add_checker(lambda m: COMMIT if m.value["order_id"] % 2 else UNKNOWN, "orders")
    settings = CheckbackConfig(
        database_url=NOWHERE, poll_interval=0.01, check_interval=1, backoff_max=4, **config
    )
    return CheckbackRunner(
        registry,
        settings,
        store=store,  # type: ignore[arg-type]
        engine=ENGINE,
    )


def test_a_round_records_every_check_with_its_backoff() -> None:
    rows = [claimed_row(value=f'{{"order_id": {n}}}'.encode(), check_count=n) for n in range(1, 4)]
    store = StubStore(rows)
    runner = stub_runner(store, concurrency=8, max_checks=5, on_max_checks="dead")
    assert runner.run_once(runner._engine) == 3  # type: ignore[arg-type]
    owner, checks, max_checks = store.recorded[0]
    assert owner == runner.owner and max_checks == 5
    assert [(c.answer, c.error) for c in checks] == [
        ("commit", None),
        ("unknown", None),
        ("commit", None),
    ]
    # The delay grows with the checks made, this one included: the third, so up to 4 s.
    assert 2 <= checks[1].delay <= 4
    assert runner.metrics.checks.labels("orders", "unknown")._value.get() == 1
    assert runner.metrics.resolved.labels("orders", "commit")._value.get() == 2
    assert runner.metrics.expired.labels("orders", "dead")._value.get() == 1
    assert runner.run_once(runner._engine) == 0  # type: ignore[arg-type]


def test_only_the_last_check_under_rollback_at_max_checks_is_asked_to_decide() -> None:
    seen: dict[int, bool] = {}

    def checker(message: CheckMessage) -> str:
        seen[message.checks] = message.final
        return UNKNOWN

    registry = CheckRegistry()
    registry.add_checker(checker, "orders")
    rows = [claimed_row(check_count=n) for n in (0, 1, 2, 3)]
    for end, finals in (("rollback", {0: False, 1: False, 2: True, 3: True}), ("dead", {})):
        store, seen = StubStore([dict(row) for row in rows]), {}
        settings = CheckbackConfig(
            database_url=NOWHERE, concurrency=8, max_checks=3, on_max_checks=end
        )
        runner = CheckbackRunner(registry, settings, store=store, engine=ENGINE)  # type: ignore[arg-type]
        assert runner.run_once(ENGINE) == 4
        expected = finals or dict.fromkeys((0, 1, 2, 3), False)
        assert seen == expected, end
        assert {c.id: c.final for c in store.recorded[0][1]} == {
            row["id"]: expected[row["check_count"]] for row in rows
        }


def test_the_loop_rides_out_a_database_outage_and_stops_when_asked() -> None:
    store = StubStore([claimed_row(value=b'{"order_id": 1}')], fail_claims=2)
    runner = stub_runner(store)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    # The round records its checks, then says the database is back: wait for both.
    while not (store.recorded and runner.health.database_ok) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.recorded, "the round after the outage recorded nothing"
    assert runner.health.database_ok and runner.health.alive
    # Counted as the loop started, before the outage: one prepared message, 12.5 s old.
    assert runner.metrics.prepared.labels("orders")._value.get() == 1
    assert runner.metrics.oldest.labels("orders")._value.get() == 12.5
    runner.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert not runner.health.ready and runner.health.not_ready_because() == "stopping"


def test_a_message_the_deserializer_cannot_read_costs_its_check_not_the_round() -> None:
    class SchemaRegistryDeserializer:
        def deserialize(self, value: bytes | None, content_type: str | None) -> Any:
            if value and b"poison" in value:
                raise KeyError("schema 42 not found")
            return {"order_id": 1}

    registry = CheckRegistry(deserializer=SchemaRegistryDeserializer())
    registry.add_checker(lambda m: COMMIT, "orders")
    poison, good = claimed_row(value=b"poison"), claimed_row()
    store = StubStore([poison, good])
    runner = CheckbackRunner(
        registry,
        CheckbackConfig(database_url=NOWHERE, check_interval=1, backoff_max=4),
        store=store,  # type: ignore[arg-type]
        engine=ENGINE,
    )
    assert runner.run_once(ENGINE) == 2
    checks = {c.id: c for c in store.recorded[0][1]}
    assert checks[good["id"]].answer == "commit"
    assert checks[poison["id"]].answer == ERROR
    assert "KeyError" in (checks[poison["id"]].error or "")


def test_the_loop_survives_an_unexpected_error_in_a_round() -> None:
    class FailingOnce(StubStore):
        def claim_due(self, *args: Any) -> Any:
            if not self.recorded and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("can't start new thread")
            return super().claim_due(*args)

    store = FailingOnce([claimed_row(value=b'{"order_id": 1}')])
    runner = stub_runner(store)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not store.recorded and time.monotonic() < deadline:
        time.sleep(0.02)
    runner.stop()
    thread.join(10)
    assert store.recorded, "the loop died of one round's error"


def test_a_checker_thread_that_cannot_start_is_an_error_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = CheckCalls(lambda group: lambda m: COMMIT, timeout=1.0)
    start = threading.Thread.start
    started: list[str] = []

    def start_once(self: threading.Thread) -> None:
        if started:
            raise RuntimeError("can't start new thread")
        started.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once)
    outcomes = calls.run([message(), message()])
    assert [o.answer for o in outcomes] == ["commit", ERROR]
    assert "can't start new thread" in (outcomes[1].error or "")


def test_a_group_with_max_hung_checks_is_not_claimed_until_they_return() -> None:
    release = threading.Event()
    registry = CheckRegistry()
    registry.add_checker(lambda m: release.wait(30) and COMMIT, "hangs")
    registry.add_checker(lambda m: COMMIT, "orders")
    rows = [claimed_row("hangs") for _ in range(6)] + [claimed_row("orders") for _ in range(3)]
    store = StubStore(rows)
    config = CheckbackConfig(
        database_url=NOWHERE, check_timeout=0.1, concurrency=2, max_hung_checks=2
    )
    runner = CheckbackRunner(registry, config, store=store, engine=ENGINE)  # type: ignore[arg-type]
    try:
        assert runner.run_once(ENGINE) == 2  # two hung calls of "hangs": the group pauses
        assert runner.calls.hung_by_group() == {"hangs": 2}
        claimed: list[list[str]] = []
        claim = store.claim_due
        store.claim_due = lambda e, o, groups, *a: (
            claimed.append(list(groups))
            or claim(  # type: ignore[method-assign]
                e, o, groups, *a
            )
        )
        for _ in range(3):
            runner.run_once(ENGINE)
        assert claimed == [["orders"]] * 3  # no more threads for the hung checker
        assert runner.calls.hung == 2
        assert runner.metrics.paused.labels("hangs")._value.get() == 1
        assert runner.metrics.skipped.labels("hangs")._value.get() == 3
        runner._tick()
        assert not runner.health.alive
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while runner.calls.hung and time.monotonic() < deadline:
        time.sleep(0.02)
    runner.run_once(ENGINE)
    assert runner.metrics.paused.labels("hangs")._value.get() == 0


def test_a_checker_error_is_stored_without_nul_or_secrets_and_bounded() -> None:
    from outbox.prepared.store import MAX_STORED_TEXT, stored_text

    text = stored_text("refused b'\x00' by postgresql://pay:hunter2@bank/x " + "x" * 5000)
    assert text is not None and "\x00" not in text and "\\x00" in text
    assert "hunter2" not in text and len(text) == MAX_STORED_TEXT
    assert stored_text(None) is None


def test_the_age_is_the_database_clocks_at_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    import outbox.prepared.checkers as checkers

    class SkewedClock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + timedelta(days=1)  # this host's clock is a day ahead

    monkeypatch.setattr(checkers, "datetime", SkewedClock)
    assert message(age_seconds=90.0).age == timedelta(seconds=90)
    assert message().age > timedelta(hours=23)  # made by hand: this host's clock


def test_a_slow_checker_holds_only_its_own_slot() -> None:
    """The next messages are checked, and recorded, while one checker is still running:
    the loop does not wait for a round's slowest checker."""
    release = threading.Event()
    registry = CheckRegistry()
    registry.add_checker(lambda m: release.wait(30) and COMMIT, "slow")
    registry.add_checker(lambda m: COMMIT, "orders")
    rows = [claimed_row("slow")] + [claimed_row("orders") for _ in range(6)]
    store = StubStore(rows)
    config = CheckbackConfig(
        database_url=NOWHERE, check_timeout=30, concurrency=2, poll_interval=0.01
    )
    runner = CheckbackRunner(registry, config, store=store, engine=ENGINE)  # type: ignore[arg-type]
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()

    def recorded(answer: str) -> int:
        return sum(1 for _, checks, _ in store.recorded for c in checks if c.answer == answer)

    try:
        deadline = time.monotonic() + 10  # far below the slow checker's 30 s
        while recorded("commit") < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert recorded("commit") == 6, "the fast checks waited for the slow one"
        assert runner.calls.in_flight == 1  # the slow one, still running
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while recorded("commit") < 7 and time.monotonic() < deadline:
        time.sleep(0.02)
    runner.stop()
    thread.join(10)
    assert recorded("commit") == 7


def test_stopping_records_the_checks_in_hand() -> None:
    release = threading.Event()
    registry = CheckRegistry()
    registry.add_checker(lambda m: release.wait(30) and COMMIT, "orders")
    store = StubStore([claimed_row("orders")])
    config = CheckbackConfig(database_url=NOWHERE, check_timeout=30, poll_interval=0.01)
    runner = CheckbackRunner(registry, config, store=store, engine=ENGINE)  # type: ignore[arg-type]
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not runner.calls.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    runner.stop()
    release.set()
    thread.join(10)
    assert [c.answer for _, checks, _ in store.recorded for c in checks] == ["commit"]
