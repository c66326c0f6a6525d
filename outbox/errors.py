"""The library's errors: one base class, one subclass per thing a caller can get wrong."""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error the outbox raises."""


class ConfigError(OutboxError, ValueError):
    """A setting is invalid (bad identifier, out-of-range size, unknown option)."""


class InvalidMessage(OutboxError, ValueError):
    """A message was refused before anything was written; the transaction is untouched."""


class InvalidTopic(InvalidMessage):
    """The topic name is not a legal Kafka topic name."""


class InvalidKey(InvalidMessage):
    """The key is ``None`` (leave it out, or ``NO_KEY``, for none), or not ``bytes``, ``str``,
    ``int`` or ``uuid.UUID``."""


class InvalidHeaders(InvalidMessage):
    """Headers are not a mapping or sequence of ``(str, bytes | str | None)`` pairs."""


class SerializationError(InvalidMessage):
    """The serializer could not turn the value into bytes.

    ``path`` says where in the value the trouble is (``value['lines'][2]``), when known;
    ``paths`` lists every place when there are several (the message names each), the first
    being ``path``.
    """

    def __init__(
        self, text: str, *, path: str | None = None, paths: list[str] | None = None
    ) -> None:
        super().__init__(text)
        self.path = path
        self.paths: tuple[str, ...] = tuple(paths or ([] if path is None else [path]))


class LossyConversion(SerializationError):
    """The value holds something JSON would change without a word: a ``set``, a dict key that
    is not a ``str``, NaN or infinity, a naive ``datetime``. ``path`` names where it is."""


class InvalidCloudEvent(InvalidMessage):
    """A CloudEvents attribute is missing or unusable: no ``type`` for the message's topic, a
    ``type`` or ``subject`` that is not a non-empty ``str``, or ``type=``/``subject=`` given to
    an outbox without a CloudEvents envelope."""


class InvalidSchedule(InvalidMessage):
    """``deliver_after``/``deliver_at`` cannot say when to deliver: both given, a naive
    ``datetime``, a negative, non-finite or too long delay, or a value of the wrong type."""


class PayloadTooLarge(InvalidMessage):
    """The serialized message exceeds the configured maximum size."""


class NotInTransaction(OutboxError):
    """``publish`` was called on a session or connection with no transaction in progress."""


class OutboxTableMissing(OutboxError):
    """The outbox table does not exist: run ``outbox db upgrade`` (or your Alembic history)."""


class PermissionDenied(OutboxError):
    """The database role lacks a privilege the operation needs (the message names it)."""


class NotPrepared(OutboxError):
    """A commit or rollback found no prepared message to decide: there is none with that id,
    or it was already decided the other way (``status`` says where it stands)."""

    def __init__(self, text: str, *, message_id: object = None, status: str | None = None):
        super().__init__(text)
        self.message_id = message_id
        self.status = status


class NotRolledBack(OutboxError):
    """A commit after a rollback (``after_rollback=True``) found the message not rolled back
    but still waiting for a verdict: ``status`` says where it stands (``prepared``, or
    ``dead`` when check-back gave up on it). Commit it without ``after_rollback``."""

    def __init__(self, text: str, *, message_id: object = None, status: str | None = None):
        super().__init__(text)
        self.message_id = message_id
        self.status = status


class IdempotencyKeyTaken(NotPrepared):
    """A commit after a rollback refused: since the rollback gave the message's idempotency key
    up, another message (``holder``, a retry: the same event) took it. Committing this one too
    would publish the event twice; ``status`` is ``rolled_back``."""

    def __init__(
        self,
        text: str,
        *,
        message_id: object = None,
        idempotency_key: str | None = None,
        holder: object = None,
    ):
        super().__init__(text, message_id=message_id, status="rolled_back")
        self.idempotency_key = idempotency_key
        self.holder = holder


class StepNotBlocked(OutboxError):
    """An operator's rollback refused: the messages' steps may still commit, and nothing made
    sure they cannot (their checker, asked to decide, blocks a step before it answers
    ROLLBACK). ``message_ids``: the messages it would have rolled back."""

    def __init__(self, text: str, *, message_ids: tuple[object, ...] = ()):
        super().__init__(text)
        self.message_ids = message_ids


class NotScheduled(OutboxError):
    """A cancel found no scheduled message to cancel: there is none with that id, or it fell
    due (it is pending or sent: it may be on its topic already). ``status`` says where it
    stands (None: no such message)."""

    def __init__(self, text: str, *, message_id: object = None, status: str | None = None):
        super().__init__(text)
        self.message_id = message_id
        self.status = status


class InvalidAnswer(OutboxError, ValueError):
    """A local transaction or a checker answered something other than COMMIT, ROLLBACK or
    UNKNOWN; the message stays prepared."""
