"""The stub-sender relay: rows sent, retried and dead-lettered on the real table."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.relay_helpers import looping, statuses, wait_for
from tests.stub_sender import StubSender, by_key_in_seq_order, publish, stub_config, stub_relay

pytestmark = pytest.mark.integration


def test_a_stub_relay_sends_retries_and_dead_letters(outbox_url: str, engine: sa.Engine) -> None:
    stub = StubSender()
    ids = publish(engine, 300, keys=7)
    doomed, flaky = ids[5], ids[9]
    tries: dict[object, int] = {}

    def decide(record):  # type: ignore[no-untyped-def]
        tries[record.id] = tries.get(record.id, 0) + 1
        if record.id == doomed:
            return "dead"
        if record.id == flaky and tries[record.id] < 3:
            return "retry"
        return "ack"

    stub.decide = decide
    with looping(stub_relay(stub_config(outbox_url), stub)):
        wait_for(lambda: statuses(engine) == {"sent": 299, "dead": 1}, 30, "all recorded")
    assert tries[flaky] == 3
    assert by_key_in_seq_order(stub.acked)
    assert len({r.id for r in stub.acked}) == 299
