"""The outbox table at revision 0011_released_idempotency_keys (docs/django.md)."""

from django.db import migrations

from outbox.django.migration import upgrade_outbox


class Migration(migrations.Migration):
    dependencies = [("outbox", "0001_outbox_table")]
    operations = [
        upgrade_outbox("0011_released_idempotency_keys", previous="0010_scheduled_messages")
    ]
