"""Committing after a check-back rollback must not publish a second message under one
idempotency key: the rollback gave the key up, and a retry may have taken it since."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from outbox import NotPrepared, Outbox
from outbox.prepared import ROLLBACK, CheckRegistry, PreparedMessages
from tests.integration import test_prepared as base
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.mark.xfail(
    strict=True,
    reason="commit --after-rollback does not see that a retry took the idempotency key since",
)
def test_after_rollback_refuses_a_message_whose_idempotency_key_a_retry_took(
    engine: sa.Engine, outbox_url: str
) -> None:
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    first = prepared.prepare(
        "orders", {"order": 41}, key=41, idempotency_key="order-41-created", group="keys"
    )
    registry = CheckRegistry()
    registry.add_checker(base.answers(ROLLBACK), "keys")
    with base.running_checkback(registry, base.fast_config(outbox_url)):
        wait_for(lambda: base.status_of(engine, first.message_id) == "rolled_back", 20, "rb")
    # The application retries the order with the same key: a new message, committed.
    retried = prepared.prepare(
        "orders", {"order": 41}, key=41, idempotency_key="order-41-created", group="keys"
    )
    assert not retried.duplicate and retried.message_id != first.message_id
    retried.commit()

    # The operator (or the documented NotPrepared handler) now commits the first one too.
    with pytest.raises(NotPrepared):
        prepared.commit(first.message_id, after_rollback=True)
    with engine.connect() as conn:
        pending = conn.execute(
            sa.text("SELECT count(*) FROM outbox WHERE status = 'pending' AND id IN (:a, :b)"),
            {"a": first.message_id, "b": retried.message_id},
        ).scalar()
    assert pending == 1  # one OrderCreated for order 41, not two
