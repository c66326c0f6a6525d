"""``outbox chaos``: a bounded, seeded fault run against a private local stack, audited by the
reconciliation job."""
