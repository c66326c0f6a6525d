"""Property-based: any input to publish() either publishes exactly what was given or raises
the documented error before anything is written, and never leaves a half-written
transaction."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox import NO_KEY, Outbox
from outbox.errors import (
    InvalidHeaders,
    InvalidKey,
    InvalidMessage,
    InvalidTopic,
    PayloadTooLarge,
    SerializationError,
)

pytestmark = pytest.mark.integration

LIMIT = 4096  # a small max_message_bytes, so oversized payloads stay cheap to make


@dataclass(frozen=True)
class Case:
    """One generated input and the error it must raise (None: it must publish)."""

    topic: Any
    key: Any
    headers: Any
    value: Any
    expected: type[InvalidMessage] | None
    idempotency_key: Any = None


_topic_chars = st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
valid_topics = st.text(_topic_chars, min_size=1, max_size=40).filter(lambda t: t not in {".", ".."})
invalid_topics = st.one_of(
    st.just(""),
    st.just(".."),
    st.text(_topic_chars, min_size=250, max_size=260),
    st.text(min_size=1, max_size=20).filter(
        lambda t: any(not c.isascii() or c in " /:*'\";" for c in t)
    ),
    st.integers(),
    st.none(),
    st.binary(min_size=1, max_size=10),
)
valid_keys = st.one_of(
    st.just(NO_KEY),
    st.binary(max_size=64),
    st.text(max_size=64),
    st.integers(),
    st.uuids(),
)
invalid_keys = st.one_of(
    st.none(),  # refused: most often an id not generated yet; NO_KEY says "no key"
    st.booleans(),
    st.floats(),
    st.lists(st.integers(), max_size=3),
    st.builds(object),
)
header_names = st.text(min_size=1, max_size=20).filter(
    lambda n: "\x00" not in n and not n.lower().startswith("outbox-")
)
header_values = st.one_of(st.none(), st.binary(max_size=32), st.text(max_size=32))
valid_headers = st.one_of(
    st.none(),
    st.dictionaries(header_names, header_values, max_size=4),
    st.lists(st.tuples(header_names, header_values), max_size=4),
)
invalid_headers = st.one_of(
    st.just("name=value"),
    st.dictionaries(header_names, st.integers(), min_size=1, max_size=2),
    st.dictionaries(st.just("outbox-id"), header_values, min_size=1, max_size=1),
    st.lists(st.tuples(st.integers(), header_values), min_size=1, max_size=2),
    st.lists(st.tuples(header_names), min_size=1, max_size=2),
    st.dictionaries(st.just("a\x00b"), header_values, min_size=1, max_size=1),
)
valid_idempotency_keys = st.one_of(
    st.none(), st.text(min_size=1, max_size=40).map(lambda k: k.replace("\x00", "")).filter(bool)
)
invalid_idempotency_keys = st.one_of(
    st.just(""), st.just("a\x00b"), st.integers(), st.binary(min_size=1, max_size=8)
)
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=40),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
valid_values = st.one_of(json_values, st.binary(max_size=256), st.text(max_size=256))
unserializable = st.one_of(
    st.builds(lambda: {"when": object()}),
    st.builds(lambda: [1, 2, object()]),
    st.builds(lambda: {"n": 2**70}),
    # What JSON would change without a word is refused, not converted.
    st.frozensets(st.integers(), max_size=3).map(lambda tags: {"tags": set(tags)}),
    st.dictionaries(st.integers(), st.text(max_size=5), min_size=1, max_size=3),
    st.builds(lambda: {"at": datetime(2026, 1, 2)}),
)
oversized = st.integers(min_value=LIMIT + 1, max_value=3 * LIMIT).map(lambda n: b"x" * n)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A valid message, or one with exactly one thing wrong."""
    topic, key = draw(valid_topics), draw(valid_keys)
    headers, value = draw(valid_headers), draw(valid_values)
    fault = draw(
        st.sampled_from(["none", "topic", "key", "headers", "value", "size", "idempotency"])
    )
    if fault == "idempotency":
        return Case(topic, key, headers, value, InvalidMessage, draw(invalid_idempotency_keys))
    if fault == "topic":
        return Case(draw(invalid_topics), key, headers, value, InvalidTopic)
    if fault == "key":
        return Case(topic, draw(invalid_keys), headers, value, InvalidKey)
    if fault == "headers":
        return Case(topic, key, draw(invalid_headers), value, InvalidHeaders)
    if fault == "value":
        return Case(topic, key, headers, draw(unserializable), SerializationError)
    if fault == "size":
        return Case(topic, key, headers, draw(oversized), PayloadTooLarge)
    return Case(topic, key, headers, value, None, draw(valid_idempotency_keys))


@pytest.fixture
def business(engine: sa.Engine) -> sa.Engine:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE business (id uuid PRIMARY KEY)"))
    return engine


def counts(engine: sa.Engine, marker: uuid.UUID) -> tuple[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT (SELECT count(*) FROM business WHERE id = :m),"
                " (SELECT count(*) FROM outbox)"
            ),
            {"m": marker},
        ).one()
    return int(rows[0]), int(rows[1])


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=cases(), keep_going=st.booleans())
def test_publish_writes_exactly_the_message_or_raises_the_documented_error(
    business: sa.Engine, case: Case, keep_going: bool
) -> None:
    ob = Outbox(business, max_message_bytes=LIMIT)
    with business.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox"))
    marker = uuid.uuid4()
    error: InvalidMessage | None = None
    try:
        with ob.transaction() as tx:
            tx.session.execute(sa.text("INSERT INTO business VALUES (:m)"), {"m": marker})
            try:
                result = tx.publish(
                    case.topic,
                    case.value,
                    key=case.key,
                    headers=case.headers,
                    idempotency_key=case.idempotency_key,
                )
            except InvalidMessage as exc:
                error = exc
                if not keep_going:
                    raise
                # The caller may catch the error and commit the rest of its transaction.
    except InvalidMessage:
        pass

    if case.expected is None:
        assert error is None, f"{case!r} was refused: {error}"
        assert counts(business, marker) == (1, 1)
        with business.connect() as conn:
            row = conn.execute(sa.text("SELECT id, topic FROM outbox")).one()
        assert row.id == result.message_id and row.topic == case.topic
    else:
        assert isinstance(error, case.expected), f"{case!r} raised {error!r}"
        assert str(error)  # a message that says what is wrong
        # Nothing half-written: the business row only if the caller went on, never the message.
        assert counts(business, marker) == ((1 if keep_going else 0), 0)
