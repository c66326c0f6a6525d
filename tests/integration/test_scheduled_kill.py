"""Scheduled messages through a relay killed (-9) while they fall due, in both modes: nothing
lost, nothing sent before its time, each key in order, and exactly-once nothing twice."""

from __future__ import annotations

import signal
import uuid
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import Message, Outbox
from outbox.devstack.topics import consume_messages
from tests.integration.test_scheduled import promote_all
from tests.relay_helpers import (
    message_id,
    start_relay_process,
    statuses,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

PLAIN = SCHEDULED = 300
KEYS = 25


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_a_relay_killed_while_messages_fall_due_loses_and_repeats_nothing(
    mode: str, engine, outbox_url, bootstrap_servers, make_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic(f"sched-kill-{mode[:5]}", partitions=3)
    prefix = f"sched-{uuid.uuid4().hex[:8]}"
    args = ["--mode", mode, "--transactional-id-prefix", prefix, "--progress-topic", f"p-{prefix}"]
    log = tmp_path / "relay.log"
    relay = start_relay_process(outbox_url, bootstrap_servers, *args, log=log)
    ob = Outbox(engine)
    start = datetime.now(UTC) + timedelta(seconds=2)
    with ob.transaction() as tx:
        plain = tx.publish_many(
            [Message(topic, {"n": n}, key=f"key-{n % KEYS}") for n in range(PLAIN)]
        )
        # Due one after another over four seconds, in the order of their numbers.
        at = [start + timedelta(seconds=4 * i / SCHEDULED) for i in range(SCHEDULED)]
        scheduled = tx.publish_many(
            [
                Message(topic, {"n": PLAIN + i}, key=f"key-{i % KEYS}", deliver_at=at[i])
                for i in range(SCHEDULED)
            ]
        )
    due = {result.message_id: at[i] for i, result in enumerate(scheduled)}
    wait_for(lambda: statuses(engine).get("sent", 0) >= PLAIN + 60, 60, "some due ones sent")
    relay.send_signal(signal.SIGKILL)  # while they fall due, most likely mid-batch
    relay.wait(10)
    wait_for(lambda: datetime.now(UTC) > start + timedelta(seconds=3), 10, "more to fall due")
    # As a relay killed right after it made them pending, before it read them.
    assert promote_all(ob.spec, outbox_url) > 0
    survivor = start_relay_process(outbox_url, bootstrap_servers, *args, log=log)
    total = PLAIN + SCHEDULED
    wait_for(lambda: statuses(engine) == {"sent": total}, 90, "every message sent")
    assert stop_process(survivor) == 0
    records = consume_messages(bootstrap_servers, topic, expect=total, timeout=90)
    copies = Counter(message_id(r) for r in records)
    assert set(copies) == {r.message_id for r in plain} | set(due)  # no loss
    if mode == "exactly-once":
        assert max(copies.values()) == 1, "read_committed saw a message twice"
    for record in records:
        mid = message_id(record)
        if mid in due:  # produced no earlier than its time (CreateTime, in milliseconds)
            assert record.timestamp()[1] >= int(due[mid].timestamp() * 1000), mid
    # Each key: its plain messages in order, then its scheduled ones in the order they fell
    # due (their numbers), whatever was sent twice.
    seen: set[uuid.UUID] = set()
    per_key: dict[bytes, list[int]] = defaultdict(list)
    for record in records:
        if message_id(record) not in seen:
            seen.add(message_id(record))
            per_key[record.key()].append(int(record.value().decode().split(":")[1].rstrip("}")))
    assert all(numbers == sorted(numbers) for numbers in per_key.values())
    with engine.connect() as conn:
        early = conn.execute(
            sa.text(
                "SELECT count(*) FROM outbox WHERE deliver_at IS NOT NULL AND sent_at < deliver_at"
            )
        ).scalar_one()
    assert early == 0
