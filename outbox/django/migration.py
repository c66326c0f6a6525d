"""The operation of the ``outbox.django`` app's migrations: run the outbox's own Alembic
revisions up to a fixed one (and back), on the database Django migrates.

Each Django migration of the app names the outbox revision it brings the table to, so
``manage.py migrate`` applies a new release's revisions (and ``manage.py migrate outbox
zero`` drops the table). The revisions run as ``outbox db upgrade`` runs them: on a
psycopg 3 connection of their own with Django's connection settings, recording their
revision in ``outbox_alembic_version``; a table already at the revision is left as it is.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import sqlalchemy as sa
from django.db import migrations

#: libpq settings that become parts of the URL; the rest of Django's connection parameters
#: that are text or numbers go in its query (sslmode, options, service...).
_URL_PARTS = ("dbname", "user", "password", "host", "port")


def upgrade_outbox(revision: str, previous: str | None) -> migrations.RunPython:
    """A migration operation that brings the outbox table to ``revision``; reversed, back to
    ``previous`` (None: drop it)."""

    def forward(_apps: Any, schema_editor: Any) -> None:
        from outbox import migrate

        with contextlib.redirect_stdout(io.StringIO()):  # Django prints the migration's OK
            migrate.upgrade(database_url(schema_editor.connection), revision=revision)

    def backward(_apps: Any, schema_editor: Any) -> None:
        from outbox import migrate

        with contextlib.redirect_stdout(io.StringIO()):
            migrate.downgrade(database_url(schema_editor.connection), revision=previous or "base")

    return migrations.RunPython(forward, backward, elidable=False)


def database_url(connection: Any) -> str:
    """A ``postgresql+psycopg://`` URL of the database Django's ``connection`` reaches, with
    its settings (``DATABASES``, its ``OPTIONS`` among them)."""
    params = connection.get_connection_params()
    query = {
        name: str(value)
        for name, value in params.items()
        if name not in _URL_PARTS and isinstance(value, str | int) and not isinstance(value, bool)
    }
    host = params.get("host") or None
    if host is not None and (host.startswith("/") or "," in host):
        query["host"], host = host, None  # a socket folder, or several hosts: libpq's own form
    port = params.get("port")
    url = sa.URL.create(
        "postgresql+psycopg",
        username=params.get("user"),
        password=params.get("password"),
        host=host,
        port=int(port) if port and host is not None else None,
        database=params.get("dbname"),
        query=query,
    )
    if port and host is None:
        url = url.update_query_dict({"port": str(port)})
    return url.render_as_string(hide_password=False)
