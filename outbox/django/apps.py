"""The Django app that installs the outbox table with ``manage.py migrate``."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    """``INSTALLED_APPS = [..., "outbox.django"]``: its migrations create and upgrade the
    outbox table (public.outbox) through the outbox's own Alembic revisions."""

    name = "outbox.django"
    label = "outbox"
    verbose_name = "Transactional outbox"
