"""Settings of the Django order service (examples/django_service).

Its database comes from ``DATABASE_URL`` (``postgresql://user:pw@host:5432/shop``); Django
connects with psycopg 3 when it is installed (outbox-kafka installs it), else psycopg2.
The ``outbox.django`` app's migration creates the outbox table with ``manage.py migrate``.
"""

from __future__ import annotations

import os

from sqlalchemy.engine import make_url

_database = make_url(os.environ.get("DATABASE_URL", "postgresql://shop@127.0.0.1:5432/shop"))

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "examples-only-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "examples.django_service.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "outbox.django",  # the outbox table, through `manage.py migrate`
    "examples.django_service.shop",
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _database.database,
        "USER": _database.username or "",
        "PASSWORD": _database.password or "",
        "HOST": _database.host or "",
        "PORT": str(_database.port or ""),
    }
}
