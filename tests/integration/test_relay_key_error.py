"""A row another transaction holds locked, in one batch with a row of another shard that fails
retriably: the relay goes on, and sends the rest once the lock goes. Real PostgreSQL and
Kafka. The failing row's topic does not exist (the broker creates none by itself), so each of
its attempts waits for the topic until the delivery timeout and fails as timed out, a
retriable failure, until the producer gives the topic up (as unknown, after 5 s): then it is
dead."""

from __future__ import annotations

import time
import uuid

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.relay.policy import RetryPolicy
from tests.relay_helpers import relay_config
from tests.relay_outside import all_sent, holding, keys_in_shards, wait_until, watched

pytestmark = pytest.mark.integration


def status(engine: sa.Engine, message_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        query = sa.text("SELECT status FROM outbox WHERE id = :id")
        return str(conn.execute(query, {"id": message_id}).scalar_one())


def test_a_locked_row_beside_a_row_that_fails_retriably_does_not_end_the_relay(  # type: ignore[no-untyped-def]
    engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    fine = make_topic("key-error-fine")
    missing = f"key-error-missing-{uuid.uuid4().hex[:8]}"  # never created
    locked_key, failing_key, later_key = keys_in_shards(3)
    ob = Outbox(engine)
    with ob.transaction() as tx:  # one batch: both are pending when the relay starts
        locked = tx.publish(fine, "locked", key=locked_key).message_id
        failing = tx.publish(missing, "failing", key=failing_key).message_id
    config = relay_config(
        outbox_url,
        bootstrap_servers,
        delivery_timeout_ms=3000,
        # Read again at once after each failure, and never dead for its attempts.
        retry=RetryPolicy(max_attempts=100, base_seconds=0.01, cap_seconds=0.02),
    )
    lock = "SELECT 1 FROM outbox WHERE id = %s FOR UPDATE"
    with holding(outbox_url, lock, locked) as release, watched(config) as relay:

        def running_and(check: object) -> bool:
            relay.assert_running()
            return bool(check)

        # The batch's first attempt times out (after 3 s): the locked row waits to be
        # marked, the failing row is sent again (an unanswered failure charges nothing).
        time.sleep(4.0)
        release()
        wait_until(lambda: running_and(all_sent(engine, [locked])), 15, "the locked row marked")
        # The failing row's attempt in flight ends after the locked row's batch was recorded:
        # the producer gives the topic up as unknown (5 s after it was first asked for), and
        # the row goes dead for it.
        wait_until(lambda: running_and(status(engine, failing) == "dead"), 20, "the row dead")
        with ob.transaction() as tx:
            later = tx.publish(fine, "later", key=later_key).message_id
        wait_until(lambda: running_and(all_sent(engine, [later])), 15, "a later row sent")
        relay.assert_running()
