"""Error fingerprints: what varies between occurrences of one cause is left out, what tells
causes apart is kept."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from outbox.errors import OutboxError
from outbox.fingerprints import (
    FailedRow,
    exception_class,
    fingerprint,
    group_by_reason,
    normalize,
    pick_group,
)

T0 = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


def test_numbers_ids_hex_and_quoted_values_are_left_out() -> None:
    text = (
        "order 1234 of 'acme' (id 0190f3c2-8d4e-7a31-9b2c-3f1e2d4c5b6a) at 0x7f3a2b "
        'tx deadbeef42 took 1.5s, "quoted"'
    )
    assert normalize(text) == (
        "order <n> of '<str>' (id <uuid>) at <hex> tx <hex> took <n>s, \"<str>\""
    )


def test_digits_inside_names_stay() -> None:
    assert normalize("utf8 decode failed on broker1 int4 column") == (
        "utf8 decode failed on broker1 int4 column"
    )
    assert normalize("rdkafka#producer-12") == "rdkafka#producer-<n>"
    assert normalize("  two\n   lines  ") == "two lines"
    assert normalize(None) == ""


def test_one_cause_one_fingerprint_and_different_causes_differ() -> None:
    same = fingerprint("handler/ValueError", "ValueError: amount 12 for order 'a-1' is negative")
    assert same == fingerprint(
        "handler/ValueError", "ValueError: amount 977 for order 'b-22' is negative"
    )
    assert len(same) == 12
    assert same != fingerprint(
        "handler/KeyError", "ValueError: amount 12 for order 'a' is negative"
    )
    assert same != fingerprint("handler/ValueError", "ValueError: amount 12 is too large")


def test_exception_class_is_read_from_the_error_text() -> None:
    assert exception_class("ValueError: bad amount", "error") == "ValueError"
    assert exception_class("app.errors.Refused: no", "error") == "app.errors.Refused"
    assert exception_class("KeyboardInterrupt", "error") == "KeyboardInterrupt"
    assert exception_class("could not decode: bad json", "error") == "error"
    assert exception_class(None, "error") == "error"


def rows() -> list[FailedRow[int]]:
    return [
        FailedRow(1, "orders", "unknown_topic", "Broker: Unknown topic or partition", T0),
        FailedRow(2, "audit", "unknown_topic", "Broker: Unknown topic or partition", T0),
        FailedRow(3, "orders", "message_too_large", "size 2000123 over 1000000", T0 + DAY),
        FailedRow(
            4, "orders", "unknown_topic", "Broker: Unknown topic or partition", T0 - timedelta(1)
        ),
        FailedRow(5, "orders", "message_too_large", "size 3000000 over 1000000", T0),
    ]


def test_groups_count_and_span_their_rows_largest_first() -> None:
    groups = group_by_reason(rows())
    assert [(g.kind, sorted(g.ids)) for g in groups] == [
        ("unknown_topic", [1, 2, 4]),
        ("message_too_large", [3, 5]),
    ]
    unknown, large = groups
    assert unknown.topics == {"orders", "audit"}
    assert (unknown.first_seen, unknown.last_seen) == (T0 - DAY, T0)
    assert large.example == "size 2000123 over 1000000"  # the latest one, as written
    assert large.pattern == "size <n> over <n>"


def test_a_reason_is_picked_by_fingerprint_or_unambiguous_prefix() -> None:
    groups = group_by_reason(rows())
    large = groups[1]
    assert pick_group(groups, large.fingerprint) is large
    assert pick_group(groups, large.fingerprint[:6].upper()) is large
    assert pick_group(groups, "000000000000") is None  # gone since: nothing to do
    with pytest.raises(OutboxError, match="not a fingerprint"):
        pick_group(groups, "abc")
    with pytest.raises(OutboxError, match="not a fingerprint"):
        pick_group(groups, "unknown_topic")


def test_the_librarys_own_frames_do_not_tell_causes_apart() -> None:
    def parked(library_frame: str, app_frame: str) -> str:
        return (
            "KeyError: 'customer_email'\nTraceback (most recent call last):\n"
            f'  File "/venv/lib/python3.11/site-packages/outbox/inbox/apply.py", line 9, in '
            f"{library_frame}\n    await self._call(tx, item)\n"
            f'  File "/app/handlers.py", line 12, in {app_frame}\n'
            '    payload["customer_email"]\n    ~~~~~~~^^^^^^^^^^^^^^^^^^'
        )

    first = parked("_careful", "send_receipt")
    assert fingerprint("handler/KeyError", first) == fingerprint(
        "handler/KeyError", parked("apply_requeued", "send_receipt")
    )
    # Where the application failed still counts.
    assert fingerprint("handler/KeyError", first) != fingerprint(
        "handler/KeyError", parked("_careful", "send_invoice")
    )
    (group,) = group_by_reason([FailedRow(1, "orders", "handler/KeyError", first, T0)])
    assert group.pattern == "KeyError: '<str>'"  # the summary, not the traceback
