"""Committing after a check-back rollback must not publish a second message under one
idempotency key: the rollback gave the key up, and a retry may have taken it since. When
none did, the commit takes the key back."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox import IdempotencyKeyTaken, NotPrepared, Outbox
from outbox.cli import main
from outbox.prepared import ROLLBACK, CheckRegistry, PreparedMessages
from tests.integration import test_prepared as base
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


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


def test_a_commit_after_rollback_takes_its_key_back_or_names_the_retry_that_holds_it(
    engine: sa.Engine, outbox_url: str
) -> None:
    prepared = PreparedMessages(Outbox(engine), check_after=0)
    kept = prepared.prepare("orders", {"order": 42}, idempotency_key="order-42", group="keys")
    lost = prepared.prepare("orders", {"order": 43}, idempotency_key="order-43", group="keys")
    registry = CheckRegistry()
    registry.add_checker(base.answers(ROLLBACK), "keys")
    with base.running_checkback(registry, base.fast_config(outbox_url)):
        for message in (kept, lost):
            wait_for(
                lambda m=message: base.status_of(engine, m.message_id) == "rolled_back", 20, ""
            )
    assert base.row(engine, kept.message_id)["released_idempotency_key"] == "order-42"
    # No retry took order-42: the commit after the rollback takes the key back with it.
    prepared.commit(kept.message_id, after_rollback=True)
    stored = base.row(engine, kept.message_id)
    assert (stored["idempotency_key"], stored["released_idempotency_key"]) == ("order-42", None)
    again = prepared.prepare("orders", {"order": 42}, idempotency_key="order-42")
    assert again.duplicate and again.message_id == kept.message_id
    # A plain message took order-43 since: refused, by the API and the command alike.
    with Outbox(engine).transaction() as tx:
        retried = tx.publish("orders", {"order": 43}, idempotency_key="order-43").message_id
    with pytest.raises(IdempotencyKeyTaken) as taken:
        prepared.commit(lost.message_id, after_rollback=True)
    assert (taken.value.holder, taken.value.idempotency_key) == (retried, "order-43")
    command = ["prepared", "commit", "--after-rollback", str(lost.message_id)]
    refused = CliRunner().invoke(main, [*command, "--database-url", outbox_url])
    assert refused.exit_code == 1
    assert f"message {retried} took it since" in refused.output
    assert base.status_of(engine, lost.message_id) == "rolled_back"
