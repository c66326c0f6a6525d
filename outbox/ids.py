"""Message ids: UUIDv7 (RFC 9562) whose timestamp never runs ahead of the clock.

The 12 ``rand_a`` bits carry the fraction of the millisecond (RFC 9562, section 6.2,
method 3), so ids made in one process sort in the order they were made, and the 48-bit
timestamp stays the true creation time: the retention purge and the reconciliation window
bound rows by it. (Counter-based generators that bump the millisecond on every call drift
ahead of the clock under load.)
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

from outbox.errors import ConfigError

_SUB_MS_STEPS = 1 << 12
_lock = threading.Lock()
_last = 0  # (millisecond << 12) | fraction, of the last id made
# Random bits need uniqueness, not secrecy: a seeded generator saves a system call per id.
# Each forked child reseeds, or two workers of one parent would draw the same bits.
_random = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _random.seed(os.urandom(32)))


def uuid7() -> uuid.UUID:
    """A new time-ordered UUIDv7, strictly greater than the previous one from this process."""
    global _last
    nanos = time.time_ns()
    stamp = (nanos // 1_000_000) << 12 | (nanos % 1_000_000) * _SUB_MS_STEPS // 1_000_000
    with _lock:
        stamp = max(stamp, _last + 1)
        _last = stamp
    millis, fraction = stamp >> 12, stamp & 0xFFF
    value = (millis << 80) | (0x7 << 76) | (fraction << 64) | (0b10 << 62) | _random.getrandbits(62)
    return uuid.UUID(int=value)


def uuid7_time_ms(value: uuid.UUID) -> int:
    """The Unix time in milliseconds that a UUIDv7 was made at."""
    return value.int >> 80


def as_message_id(message_id: object) -> uuid.UUID:
    """A message id given as a UUID or its string; anything else is a ``ConfigError``."""
    if isinstance(message_id, uuid.UUID):
        return message_id
    if isinstance(message_id, str):
        try:
            return uuid.UUID(message_id)
        except ValueError:
            pass
    raise ConfigError(f"a message id is a UUID, got {message_id!r}")
