"""Upgrading to revision 0007 while messages wait for a verdict: a check that failed before
the upgrade must still keep the message from ending rolled back at max_checks."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from outbox import migrate
from outbox.prepared import UNKNOWN, CheckRegistry
from tests.integration import test_prepared as base
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


def test_a_check_that_failed_before_the_upgrade_still_counts(database_url: str) -> None:
    migrate.upgrade(database_url, revision="0006_wake_lock_in_condition")
    engine = sa.create_engine(database_url)
    try:
        # Prepared by a producer of that version (this one writes columns of later
        # revisions), checked twice before the upgrade; the last check failed.
        message_id = uuid.uuid4()
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO outbox (id, shard, topic, value, content_type, status, "
                    "prepared_at, check_group, next_check_at, check_count, last_check_answer, "
                    "last_check_error) VALUES (:id, 0, 'orders', :value, "
                    "'application/json', 'prepared', now(), 'upgraded', now(), 2, 'error', "
                    "'ConnectionError: orders database unreachable')"
                ),
                {"id": message_id, "value": b'{"n":1}'},
            )
        migrate.upgrade(database_url)
        registry = CheckRegistry()
        registry.add_checker(base.answers(UNKNOWN), "upgraded")
        config = base.fast_config(database_url, max_checks=3, on_max_checks="rollback")
        with base.running_checkback(registry, config):
            wait_for(lambda: base.status_of(engine, message_id) != "prepared", 30, "end")
        assert base.status_of(engine, message_id) == "dead"
    finally:
        engine.dispose()
