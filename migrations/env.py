"""Alembic environment for the outbox table's own migration history.

Its version table is ``<table>_alembic_version`` in the outbox schema, so it never collides
with the history of the service that owns the database (see :mod:`outbox.alembic_histories`).
"""

from __future__ import annotations

from outbox.alembic_histories import run_environment
from outbox.migration_support import current_spec, current_url

spec = current_spec()
spec.table_obj  # noqa: B018 - declares the table on the metadata for autogenerate
run_environment(current_url(), spec, {spec.table}, spec.metadata)
