"""The order service's tests run under pytest-django with the outbox's fixture ``published``
(docs/django.md)::

    DJANGO_SETTINGS_MODULE=examples.django_service.settings \\
    DATABASE_URL=postgresql://postgres:pw@127.0.0.1:5432/shop pytest examples/django_service
"""

pytest_plugins = ["outbox.django.testing"]
