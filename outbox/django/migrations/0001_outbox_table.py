"""The outbox table at revision 0010_scheduled_messages (docs/django.md)."""

from django.db import migrations

from outbox.django.migration import upgrade_outbox


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [upgrade_outbox("0010_scheduled_messages", previous=None)]
