"""Upgrading to revision 0007 while messages wait for a verdict: a check that failed before
the upgrade must still keep the message from ending rolled back at max_checks."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from outbox import Outbox, migrate
from outbox.prepared import UNKNOWN, CheckRegistry, PreparedMessages
from tests.integration import test_prepared as base
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


def test_a_check_that_failed_before_the_upgrade_still_counts(database_url: str) -> None:
    migrate.upgrade(database_url, revision="0006_wake_lock_in_condition")
    engine = sa.create_engine(database_url)
    try:
        prepared = PreparedMessages(Outbox(engine), check_after=0)
        message = prepared.prepare("orders", {"n": 1}, group="upgraded")
        with engine.begin() as conn:  # checked twice before the upgrade; the last one failed
            conn.execute(
                sa.text(
                    "UPDATE outbox SET check_count = 2, last_check_answer = 'error', "
                    "last_check_error = 'ConnectionError: orders database unreachable' "
                    "WHERE id = :id"
                ),
                {"id": message.message_id},
            )
        migrate.upgrade(database_url)
        registry = CheckRegistry()
        registry.add_checker(base.answers(UNKNOWN), "upgraded")
        config = base.fast_config(database_url, max_checks=3, on_max_checks="rollback")
        with base.running_checkback(registry, config):
            wait_for(lambda: base.status_of(engine, message.message_id) != "prepared", 30, "end")
        assert base.status_of(engine, message.message_id) == "dead"
    finally:
        engine.dispose()
