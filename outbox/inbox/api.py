"""The consuming application's side: an :class:`Inbox` with handlers declared per topic.

::

    inbox = Inbox(group="billing")

    @inbox.handler("orders")
    def on_order(message: InboxMessage, session: Session) -> None:
        session.add(LedgerEntry(order_id=message.value["order_id"], ...))
        outbox.publish(session, "invoices", {...})  # commits with the effects, or not at all

    @inbox.batch_handler("payments")
    def on_payments(messages: list[InboxMessage], session: Session) -> None:
        session.execute(insert(payments), [m.value for m in messages])  # one statement

The runner (``outbox consume module:inbox``) hands each handler a session inside an open
transaction; the inbox row that marks the message as applied is written in that same
transaction, so the effects happen once however often Kafka delivers the record.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeAlias

from outbox.cloudevents import record_identity
from outbox.decoding import Deserializer, JsonDeserializer, last_header
from outbox.errors import ConfigError
from outbox.loading import load_target, register_once
from outbox.message import ID_HEADER
from outbox.validation import validate_topic

if TYPE_CHECKING:
    from outbox.inbox.dead_letters import DeadLetters


@dataclass(frozen=True)
class InboxMessage:
    """One Kafka record as a handler sees it."""

    #: The message identity the inbox deduplicates on: the ``outbox-id`` header's UUID in
    #: text form, or the fallback identity (see :class:`Inbox`).
    id: str
    topic: str
    key: bytes | None
    #: The value as the inbox's deserializer decoded it.
    value: Any
    headers: tuple[tuple[str, bytes | None], ...]
    partition: int
    offset: int
    #: The undecoded value.
    raw_value: bytes | None = None

    def header(self, name: str) -> bytes | None:
        """The last value of header ``name``, or None."""
        return last_header(self.headers, name)


@dataclass(frozen=True)
class RawRecord:
    """What an identity function gets: the record before decoding."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]


IdentityFn: TypeAlias = Callable[[RawRecord], "str | None"]
SyncHandler: TypeAlias = Callable[[InboxMessage, Any], None]
AsyncHandler: TypeAlias = Callable[[InboxMessage, Any], Awaitable[None]]
SyncBatchHandler: TypeAlias = Callable[[list[InboxMessage], Any], None]
AsyncBatchHandler: TypeAlias = Callable[[list[InboxMessage], Any], Awaitable[None]]

#: Records without the id header are parked (the default): nothing is applied unchecked.
PARK = "park"
#: Records without the id header are identified by ``topic/partition/offset``: replays of
#: the *same* record are caught, a second copy produced at another offset is not.
BY_OFFSET = "offset"


class MissingIdentity(Exception):
    """A record has no message identity and the inbox is told to park such records."""


class Inbox:
    """Handlers per topic for one consumer group, and how records are identified and decoded.

    ``group``: the Kafka consumer group, also the first half of the inbox table's key (two
    groups reading the same topic apply each message once each).
    ``deserializer``: turns values into Python objects (default: JSON, text, bytes by the
    ``content-type`` header). ``id_header``: the header carrying the message id
    (``outbox-id``, set by the relay). A record without it that is a CloudEvent is identified
    by its ``id`` (the ``ce_id`` header; see :func:`outbox.cloudevents.record_identity`).
    ``missing_id``: what to do with records that have neither:
    ``"park"`` (default), ``"offset"`` (identity ``topic/partition/offset``), or a function
    ``RawRecord -> str | None`` (e.g. a business key; None parks the record).
    ``dead_letters``: also send what is parked to dead-letter topics, through the
    consumer's outbox (:class:`~outbox.inbox.dead_letters.DeadLetters`; off by default).
    """

    def __init__(
        self,
        group: str,
        *,
        deserializer: Deserializer | None = None,
        id_header: str = ID_HEADER,
        missing_id: str | IdentityFn = PARK,
        dead_letters: DeadLetters | None = None,
    ) -> None:
        if not isinstance(group, str) or not group.strip():
            raise ConfigError("inbox group must be a non-empty str (the Kafka consumer group)")
        if deserializer is not None and not callable(getattr(deserializer, "deserialize", None)):
            raise ConfigError("deserializer must have a deserialize(value, content_type) method")
        if not isinstance(id_header, str) or not id_header:
            raise ConfigError("id_header must be a non-empty str")
        if not (missing_id in (PARK, BY_OFFSET) or callable(missing_id)):
            raise ConfigError(
                f"missing_id must be {PARK!r}, {BY_OFFSET!r} or a function, got {missing_id!r}"
            )
        if dead_letters is not None:
            from outbox.inbox.dead_letters import DeadLetters

            if not isinstance(dead_letters, DeadLetters):
                raise ConfigError("dead_letters must be an outbox.inbox.DeadLetters")
        self.dead_letters = dead_letters
        self.group = group
        self.deserializer: Deserializer = deserializer or JsonDeserializer()
        self.id_header = id_header
        self.missing_id = missing_id
        self._handlers: dict[str, Callable[..., Any]] = {}
        self._batch_topics: set[str] = set()

    def handler(self, *topics: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: ``fn(message, session)`` handles records of ``topics``, one at a time.

        Every handler of one inbox is either a plain function (it gets a ``Session``) or a
        coroutine function (it gets an ``AsyncSession``).
        """

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.add_handler(fn, *topics)
            return fn

        return register

    def batch_handler(self, *topics: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: ``fn(messages, session)`` handles the records of ``topics`` a batch at
        a time, so that it can write all their rows with one statement.

        ``messages`` are the batch's new messages of one topic (duplicates already left out),
        in the order read, so in offset order per partition. If ``fn`` raises, the batch is
        rolled back and applied again one message at a time, each in a savepoint of its own
        (``fn`` then gets one-message lists): the failing message is retried and parked like
        a :meth:`handler`'s, the others commit. Plain or coroutine function, as for
        :meth:`handler`.
        """

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.add_batch_handler(fn, *topics)
            return fn

        return register

    def add_handler(self, fn: Callable[..., Any], *topics: str) -> None:
        """Register ``fn`` for ``topics`` (what :meth:`handler` does)."""
        self._register(fn, topics, batch=False)

    def add_batch_handler(self, fn: Callable[..., Any], *topics: str) -> None:
        """Register ``fn`` for batches of ``topics`` (what :meth:`batch_handler` does)."""
        self._register(fn, topics, batch=True)

    def _register(self, fn: Callable[..., Any], topics: tuple[str, ...], batch: bool) -> None:
        if callable(fn) and self._handlers and self.is_async != inspect.iscoroutinefunction(fn):
            raise ConfigError(
                "an inbox's handlers must be all sync or all async (one session kind per "
                "transaction); use two inboxes with two consumer groups to mix them"
            )
        register_once(
            self._handlers, fn, topics, validate=validate_topic, what="handler", name_kind="topic"
        )
        if batch:
            self._batch_topics.update(topics)

    @property
    def topics(self) -> list[str]:
        return list(self._handlers)

    @property
    def handlers(self) -> Mapping[str, Callable[..., Any]]:
        """Every topic's handler, per-message and batch ones alike (read-only)."""
        return MappingProxyType(self._handlers)

    def takes_batches(self, topic: str) -> bool:
        """Whether ``topic``'s handler is a batch handler."""
        return topic in self._batch_topics

    @property
    def is_async(self) -> bool:
        return any(inspect.iscoroutinefunction(fn) for fn in self._handlers.values())

    def identify(self, record: RawRecord) -> str:
        """The record's message identity; raises :class:`MissingIdentity` when it has none."""
        raw = None
        for name, value in record.headers:
            if name == self.id_header:
                raw = value
        if raw is not None:
            text = raw.decode("ascii", errors="replace").strip()
            try:
                return str(uuid.UUID(text)) if self.id_header == ID_HEADER else text
            except ValueError:
                raise MissingIdentity(f"header {self.id_header} is not a UUID: {text!r}") from None
        cloud_event = record_identity(record.headers, record.value)
        if cloud_event is not None:
            return cloud_event
        if self.missing_id == BY_OFFSET:
            return f"{record.topic}/{record.partition}/{record.offset}"
        if callable(self.missing_id):
            identity = self.missing_id(record)
            if identity:
                return str(identity)
            raise MissingIdentity("the identity function returned nothing")
        raise MissingIdentity(f"record has no {self.id_header} header")

    def decode(self, record: RawRecord, identity: str) -> InboxMessage:
        """The message a handler gets; raises for a value the deserializer cannot read."""
        content_type = None
        for name, value in record.headers:
            if name == "content-type" and value is not None:
                content_type = value.decode("ascii", errors="replace")
        return InboxMessage(
            id=identity,
            topic=record.topic,
            key=record.key,
            value=self.deserializer.deserialize(record.value, content_type),
            headers=record.headers,
            partition=record.partition,
            offset=record.offset,
            raw_value=record.value,
        )


def load_inbox(target: str) -> Inbox:
    """``"package.module:name"`` -> the :class:`Inbox` object it names."""
    found = load_target(target, "myapp.handlers:inbox")
    if not isinstance(found, Inbox):
        raise ConfigError(f"{target} is not an outbox.inbox.Inbox (got {type(found).__name__})")
    if not found.topics:
        raise ConfigError(f"{target} has no handlers")
    return found
