"""Every way a row becomes sendable wakes an idle relay: an insert, the immediate sender giving
rows back (a failed send, its order check), ``outbox dead retry``, a prepared message's
commit and reconciliation's repair. Each is picked up by a sleeping relay whose poll interval
is 5 s far sooner than that. Real relay loop on a real PostgreSQL, stub sender."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox.cli import main
from outbox.immediate import ImmediateSender, SendOutcome
from outbox.prepared.store import PreparedStore
from outbox.relay.commands import Batch
from outbox.relay.daemon import Parts, Relay, _real_parts
from outbox.relay.store import RelayStore
from outbox.relay.table_source import TableSource
from outbox.rows import OutboxRows
from outbox.schema import DEFAULT_SPEC, shard_of
from outbox.sending import Ack
from outbox.spark_jobs.repair import requeue_missing
from tests.relay_helpers import looping, owns_all_and_sleeps, wait_for
from tests.stub_sender import StubSender, stub_config, stub_relay

pytestmark = pytest.mark.integration

#: The relay's poll interval: without a wake-up, a row waits up to this long.
POLL = 5.0
#: What the tests assert: far below the poll interval, far above a wake-up's few milliseconds.
BOUND = 1.0


class TimedStub(StubSender):
    """A stub sender that notes when each row was first sent (``time.monotonic()`` when its
    batch started): a relay's pick-up, measured to the millisecond, whatever the stub's and
    the test's own waits."""

    def __init__(self, latency: float = 0.002) -> None:
        super().__init__(latency)
        self.sent_at: dict[uuid.UUID, float] = {}

    def start(self, batch: Batch) -> None:
        now = time.monotonic()
        for record in batch.records:
            self.sent_at.setdefault(record.id, now)
        super().start(batch)

    def acked_ids(self) -> set[uuid.UUID]:
        return {record.id for record in self.acked}


def sleeping_stub_relay(
    outbox_url: str, store: RelayStore | None = None, **overrides: object
) -> tuple[Relay, TimedStub]:
    """A stub relay polling every POLL seconds (and rebalancing as often: no look between);
    reading on ``store`` when given."""
    stub = TimedStub()
    options: dict[str, object] = {"poll_interval": POLL, "rebalance_interval": POLL, **overrides}
    config = stub_config(outbox_url, **options)
    if store is None:
        return stub_relay(config, stub), stub

    def parts(relay: Relay) -> Parts:
        return dataclasses.replace(
            _real_parts(relay),
            source=TableSource(relay.config, store, relay.metrics),
            make_sender=lambda _relay: stub,
        )

    return Relay(config, parts=parts), stub


def in_seconds(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


def insert_row(engine: sa.Engine, key: str, **columns: object) -> uuid.UUID:
    """One row of ``key`` with the given column values (an insert, which wakes the relay
    itself: the tests let it fall asleep again before they act)."""
    row_id = uuid.uuid4()
    names = ", ".join(columns)
    values = ", ".join(f":{name}" for name in columns)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO outbox (id, shard, topic, key, value{', ' if names else ''}{names}) "
                f"VALUES (:id, :shard, 'wake', :key, :value{', ' if values else ''}{values})"
            ),
            {
                "id": row_id,
                "shard": shard_of(key.encode(), row_id),
                "key": key.encode(),
                "value": b"v",
                **columns,
            },
        )
    return row_id


Path = Callable[[sa.Engine, str], Callable[[], list[uuid.UUID]]]


def released_after_a_failed_send(engine: sa.Engine, url: str) -> Callable[[], list[uuid.UUID]]:
    owner = "immediate-test"
    row = insert_row(engine, "a", lease_owner=owner, lease_until=in_seconds(3600))

    def act() -> list[uuid.UUID]:
        rows = OutboxRows(url, DEFAULT_SPEC, owner)
        try:
            rows.record_outcome([], released=[row])  # what a failed immediate send does
        finally:
            rows.close()
        return [row]

    return act


def released_by_the_order_check(engine: sa.Engine, url: str) -> Callable[[], list[uuid.UUID]]:
    """The key's earlier row is in flight with another immediate sender: this sender's order
    check gives the later row back (an UPDATE), and the other sender then marks its row sent
    (another UPDATE). Neither inserts: the later row goes at once all the same."""
    sender = ImmediateSender(url, {"bootstrap.servers": "127.0.0.1:9", "log_level": 0})
    other = "another-sender"
    earlier = insert_row(engine, "b", lease_owner=other, lease_until=in_seconds(3600))
    later = insert_row(engine, "b", lease_owner=sender.owner, lease_until=in_seconds(3600))

    def act() -> list[uuid.UUID]:
        try:
            outcome = SendOutcome()
            records, _ = sender._clear_to_send([later], outcome)
            assert records == [] and outcome.left_to_relay == [later]
        finally:
            sender.close(5)
        rows = OutboxRows(url, DEFAULT_SPEC, other)
        try:
            rows.record_outcome([Ack(earlier, 0, 1)])  # what the other sender's success does
        finally:
            rows.close()
        return [later]

    return act


def dead_retry(engine: sa.Engine, url: str) -> Callable[[], list[uuid.UUID]]:
    row = insert_row(engine, "c", status="dead", error_kind="message_too_large")

    def act() -> list[uuid.UUID]:
        result = CliRunner().invoke(main, ["dead", "retry", "--database-url", url, str(row)])
        assert result.exit_code == 0, result.output
        return [row]

    return act


def prepared_commit(engine: sa.Engine, url: str) -> Callable[[], list[uuid.UUID]]:
    row = insert_row(
        engine,
        "d",
        status="prepared",
        prepared_at=in_seconds(0),
        check_group="g",
        next_check_at=in_seconds(3600),
    )

    def act() -> list[uuid.UUID]:
        with engine.begin() as conn:
            assert PreparedStore(DEFAULT_SPEC).commit(conn, [row], by="operator") == 1
        return [row]

    return act


def repair(engine: sa.Engine, url: str) -> Callable[[], list[uuid.UUID]]:
    row = insert_row(
        engine, "e", status="sent", sent_at=in_seconds(0), kafka_partition=0, kafka_offset=7
    )

    def act() -> list[uuid.UUID]:
        assert requeue_missing(engine, DEFAULT_SPEC, [str(row)]) == 1
        return [row]

    return act


@pytest.mark.parametrize(
    "path",
    [
        released_after_a_failed_send,
        released_by_the_order_check,
        dead_retry,
        prepared_commit,
        repair,
    ],
)
def test_a_row_made_sendable_wakes_a_sleeping_relay(engine, outbox_url, path: Path) -> None:  # type: ignore[no-untyped-def]
    relay, stub = sleeping_stub_relay(outbox_url)
    with looping(relay):
        wait_for(lambda: owns_all_and_sleeps(relay), 30, "the relay to own every shard and sleep")
        act = path(engine, outbox_url)
        time.sleep(0.3)  # the relay looked at the rows written above, and sleeps again
        assert relay.asleep and not stub.acked
        started = time.monotonic()
        expected = set(act())
        wait_for(lambda: expected <= stub.acked_ids(), POLL + 2, "the rows made sendable sent")
        picked_up = max(stub.sent_at[row] for row in expected) - started
    print(f"{path.__name__}: picked up after {picked_up * 1000:.1f} ms")
    assert picked_up < BOUND, picked_up
