"""Alembic environment for the inbox tables' own, opt-in history (branch ``inbox``).

Kept apart from the outbox's history so that ``outbox db upgrade`` never creates inbox
tables and the outbox's revisions stay one linear chain. Its version table is
``<inbox table>_alembic_version`` beside the inbox tables (see
:mod:`outbox.alembic_histories`).
"""

from __future__ import annotations

from outbox.alembic_histories import run_environment
from outbox.inbox.migrate import current_inbox_spec
from outbox.migration_support import current_url

spec = current_inbox_spec()
spec.inbox  # noqa: B018 - declares the tables on the metadata for autogenerate
spec.parked  # noqa: B018
run_environment(current_url(), spec, {spec.table, spec.parked_name}, spec.metadata)
