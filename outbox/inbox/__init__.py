"""The inbox: exactly-once effects in consuming services.

A consuming service declares handlers on an :class:`Inbox`; the runner (``outbox consume
myapp.handlers:inbox``, or :class:`InboxRunner` embedded) reads the topics and applies each
record in the service's own database transaction together with an inbox row keyed by the
consumer group and the message id (the relay's ``outbox-id`` header). A record delivered
again finds its row and is skipped, so its effects happen once. See docs/inbox.md.

::

    from outbox.inbox import Inbox, InboxMessage

    inbox = Inbox(group="billing")

    @inbox.handler("orders")
    def on_order(message: InboxMessage, session: Session) -> None:
        session.execute(insert(ledger).values(order_id=message.value["order_id"]))

The runner and the migrations load on first use, so that ``outbox consume`` and ``outbox
inbox`` set up their signal handling before librdkafka, Alembic and the Prometheus client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from outbox.decoding import (
    BytesDeserializer,
    Deserializer,
    JsonDeserializer,
    UndecodableValue,
)
from outbox.inbox.api import BY_OFFSET, PARK, Inbox, InboxMessage, RawRecord, load_inbox
from outbox.inbox.config import ConsumerConfig
from outbox.inbox.dead_letter_retry import DeadLetter, NotADeadLetter
from outbox.inbox.dead_letters import DeadLetters
from outbox.inbox.schema import InboxTableSpec
from outbox.inbox.store import InboxStore

if TYPE_CHECKING:
    from outbox.inbox.migrate import declare_inbox, install
    from outbox.inbox.runner import InboxRunner

__all__ = [
    "BY_OFFSET",
    "PARK",
    "BytesDeserializer",
    "ConsumerConfig",
    "DeadLetter",
    "DeadLetters",
    "Deserializer",
    "Inbox",
    "InboxMessage",
    "InboxRunner",
    "InboxStore",
    "InboxTableSpec",
    "JsonDeserializer",
    "NotADeadLetter",
    "RawRecord",
    "UndecodableValue",
    "declare_inbox",
    "install",
    "load_inbox",
]


def __getattr__(name: str) -> Any:
    # The runner brings librdkafka and the Prometheus client, the migrations Alembic.
    if name == "InboxRunner":
        from outbox.inbox.runner import InboxRunner

        return InboxRunner
    if name in ("declare_inbox", "install"):
        from outbox.inbox import migrate

        return getattr(migrate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
