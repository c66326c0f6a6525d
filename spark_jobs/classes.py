"""The names of the discrepancy classes, in report order.

Plain Python, so the parts that only read a run's output (``outbox reconcile show`` and
``list``, the report) work without PySpark. What each class means is decided in
:mod:`outbox.spark_jobs.discrepancies`.
"""

from __future__ import annotations

MISSING, DUPLICATE, PHANTOM = "missing", "duplicate", "phantom"
PAYLOAD_MISMATCH, MISROUTED, OFFSET_MISMATCH = "payload_mismatch", "misrouted", "offset_mismatch"
STUCK, LATE = "stuck", "late"
CLASSES = (MISSING, DUPLICATE, PHANTOM, PAYLOAD_MISMATCH, MISROUTED, OFFSET_MISMATCH, STUCK, LATE)
