"""The database roles docs/operations.md recommends: a publishing service's grants are enough to
publish (with idempotency keys too), and the purge job's to purge. (The relay's are checked by
test_relay_privileges.py, the audit's by the reconciliation tests' docs.)"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from outbox import Outbox, PermissionDenied
from outbox.retention import purge_sent

pytestmark = pytest.mark.integration

#: docs/operations.md, "Database roles".
SERVICE_GRANTS = (
    "GRANT USAGE ON SCHEMA public TO {role}",
    "GRANT INSERT ON public.outbox TO {role}",
    "GRANT SELECT (id, idempotency_key) ON public.outbox TO {role}",
)
PURGE_GRANTS = (
    "GRANT USAGE ON SCHEMA public TO {role}",
    "GRANT SELECT, UPDATE, DELETE ON public.outbox TO {role}",
)


def test_a_service_publishes_with_the_documented_grants(engine, login_role) -> None:  # type: ignore[no-untyped-def]
    service = sa.create_engine(login_role(*SERVICE_GRANTS))
    try:
        ob = Outbox(service)
        with ob.transaction() as tx:
            first = tx.publish("orders", {"n": 1}, key=1, idempotency_key="order-1")
            tx.publish("orders", {"n": 2}, key=2)
        with ob.transaction() as tx:
            again = tx.publish("orders", {"n": 1}, key=1, idempotency_key="order-1")
        assert again.duplicate and again.message_id == first.message_id
    finally:
        service.dispose()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 2


def test_a_service_without_insert_is_told_which_grant_is_missing(login_role) -> None:  # type: ignore[no-untyped-def]
    service = sa.create_engine(login_role(*SERVICE_GRANTS[:1]))
    try:
        with (
            pytest.raises(PermissionDenied, match="GRANT INSERT"),
            Outbox(service).transaction() as tx,
        ):
            tx.publish("orders", {"n": 1})
    finally:
        service.dispose()


def test_the_purge_runs_with_the_documented_grants(engine, login_role) -> None:  # type: ignore[no-untyped-def]
    with Outbox(engine).transaction() as tx:
        tx.publish("orders", {"n": 1})
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox SET status = 'sent', sent_at = now()"))
    later = datetime.now(UTC) + timedelta(minutes=1)
    purger = sa.create_engine(login_role(*PURGE_GRANTS))
    try:
        assert purge_sent(purger, timedelta(0), now=later) == 1
    finally:
        purger.dispose()
