"""Prepared messages with check-back: RocketMQ's transactional messages on the outbox table.

For a business step outside the outbox's database (a payment provider, a second database,
another service): prepare the message (committed, invisible to the relay), run the step, then
commit or roll the message back. When that word is lost, a check-back runner in the service
asks the checker registered for the message. See docs/prepared-messages.md.

::

    from outbox.prepared import COMMIT, ROLLBACK, UNKNOWN, CheckRegistry, PreparedMessages

    prepared = PreparedMessages(ob)
    result = prepared.send_in_transaction(Message("orders", order, key=order_id), create_order)

    registry = CheckRegistry()  # run with `outbox checkback myapp.checks:registry`

    steps = StepLog()  # the step records its message id: steps.record(conn, message_id)

    @registry.checker("orders")
    def order_created(message: CheckMessage) -> Answer:
        return steps.answer(orders_db, message)

The runner (:class:`CheckbackRunner`, :class:`CheckbackMetrics`) loads the Prometheus client
on first use, so a service that only prepares messages does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from outbox.errors import StepNotBlocked
from outbox.prepared.answers import COMMIT, ROLLBACK, UNKNOWN, Answer
from outbox.prepared.api import Prepared, PreparedMessages, TransactionResult
from outbox.prepared.checkers import CheckMessage, CheckRegistry, load_registry
from outbox.prepared.config import DEAD_AT_MAX, ROLLBACK_AT_MAX, CheckbackConfig
from outbox.prepared.steps import StepAbandoned, StepInProgress, StepLog, bound_step

if TYPE_CHECKING:
    from outbox.prepared.metrics import CheckbackMetrics
    from outbox.prepared.runner import CheckbackRunner

__all__ = [
    "COMMIT",
    "DEAD_AT_MAX",
    "ROLLBACK",
    "ROLLBACK_AT_MAX",
    "UNKNOWN",
    "Answer",
    "CheckMessage",
    "CheckRegistry",
    "CheckbackConfig",
    "CheckbackMetrics",
    "CheckbackRunner",
    "Prepared",
    "PreparedMessages",
    "StepAbandoned",
    "StepInProgress",
    "StepLog",
    "StepNotBlocked",
    "TransactionResult",
    "bound_step",
    "load_registry",
]


def __getattr__(name: str) -> Any:
    if name == "CheckbackRunner":
        from outbox.prepared.runner import CheckbackRunner

        return CheckbackRunner
    if name == "CheckbackMetrics":
        from outbox.prepared.metrics import CheckbackMetrics

        return CheckbackMetrics
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
