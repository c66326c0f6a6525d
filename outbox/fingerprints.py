"""Error fingerprints: dead messages and parked inbox rows grouped by cause.

After an incident an operator has thousands of failed messages and a handful of causes. Their
error texts differ only in what varies between occurrences (a message id, an offset, a size,
a quoted value), so each text is normalized (those parts replaced by placeholders) and the
error's class plus the normalized text make its *fingerprint*: a short hash that names one
cause, for ``outbox dead list --by-reason`` and ``outbox dead retry --reason FINGERPRINT``
(and the same for parked inbox rows).

The normalization lives here only, in Python: the commands read the failed rows' errors and
group them here, and a retry by reason names the rows of one group by their ids.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Generic, TypeVar

from outbox.errors import OutboxError
from outbox.traceback_text import error_line, split_error, without_library_frames

Id = TypeVar("Id")

#: Characters of the hash shown; a retry accepts any unambiguous prefix of at least MIN_PREFIX.
FINGERPRINT_LENGTH = 12
MIN_PREFIX = 6
#: Normalized texts are cut here: a cause is named by its start, not by a whole traceback.
MAX_PATTERN = 300

# Order matters: quoted values first (they may hold anything), then ids, then numbers.
_REPLACEMENTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"'[^'\n]*'"), "'<str>'"),
    (re.compile(r'"[^"\n]*"'), '"<str>"'),
    (
        re.compile(
            r"\b[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}\b"
        ),
        "<uuid>",
    ),
    (re.compile(r"\b0[xX][0-9a-fA-F]+\b"), "<hex>"),
    # Bare hex of 8 or more characters with at least one digit (a hash, a transaction id),
    # not a long word made of the letters a-f.
    (re.compile(r"\b(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{8,}\b"), "<hex>"),
    # Numbers (an offset, a size, the 1.5 of 1.5s, a version 3.9.1); digits at the end of
    # a name (utf8, int4, broker1) are part of the name.
    (re.compile(r"(?<![A-Za-z_\d.])\d+(?:\.\d+)*"), "<n>"),
    (re.compile(r"\s+"), " "),
)


def normalize(message: str | None) -> str:
    """``message`` with what varies between occurrences replaced by placeholders.

    >>> normalize("offset 1234 of 'orders-7' for 0190f3c2-8d4e-7a31-9b2c-3f1e2d4c5b6a")
    "offset <n> of '<str>' for <uuid>"
    """
    text = (message or "").strip()
    for pattern, placeholder in _REPLACEMENTS:
        text = pattern.sub(placeholder, text)
    return text[:MAX_PATTERN]


def _cause_text(message: str | None) -> str:
    """What names a cause in ``message``: its text normalized, without the frames of the
    outbox package's own code in its traceback (one error that the library ran by two ways,
    a first delivery and an operator's retry, is one cause)."""
    return normalize(without_library_frames(message or ""))


def shown_pattern(message: str | None) -> str:
    """The pattern shown for a cause: ``message``'s summary normalized (its traceback, when
    it has one, counts for the fingerprint but is not shown)."""
    return normalize(split_error((message or "").strip())[0])


def fingerprint(kind: str, message: str | None) -> str:
    """The fingerprint of an error of class ``kind`` with text ``message``."""
    digest = hashlib.sha256(f"{kind}\0{_cause_text(message)}".encode()).hexdigest()
    return digest[:FINGERPRINT_LENGTH]


def exception_class(error: str | None, fallback: str) -> str:
    """The exception class at the start of a ``traceback.format_exception_only`` text
    (``ValueError: ...`` -> ``ValueError``), or ``fallback``."""
    match = re.match(r"([A-Za-z_][\w.]*)(?::|$)", (error or "").strip())
    return match.group(1) if match else fallback


@dataclass
class ReasonGroup(Generic[Id]):
    """The failed rows of one cause."""

    fingerprint: str
    kind: str
    pattern: str
    #: The most recent row's error, as it was written.
    example: str
    first_seen: datetime
    last_seen: datetime
    ids: list[Id] = field(default_factory=list)
    topics: set[str] = field(default_factory=set)

    @property
    def count(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class FailedRow(Generic[Id]):
    """What grouping needs of a dead message or a parked inbox row."""

    id: Id
    topic: str
    kind: str
    error: str | None
    seen_at: datetime


def group_by_reason(rows: Iterable[FailedRow[Id]]) -> list[ReasonGroup[Id]]:
    """``rows`` grouped by fingerprint, the largest group first (then the most recent)."""
    groups: dict[str, ReasonGroup[Id]] = {}
    for row in rows:
        key = fingerprint(row.kind, row.error)
        group = groups.get(key)
        if group is None:
            group = groups[key] = ReasonGroup(
                fingerprint=key,
                kind=row.kind,
                pattern=shown_pattern(row.error),
                example=(row.error or "").strip(),
                first_seen=row.seen_at,
                last_seen=row.seen_at,
            )
        group.ids.append(row.id)
        group.topics.add(row.topic)
        group.first_seen = min(group.first_seen, row.seen_at)
        if row.seen_at >= group.last_seen:
            group.last_seen = row.seen_at
            group.example = (row.error or "").strip()
    return sorted(groups.values(), key=lambda g: (-g.count, -g.last_seen.timestamp()))


def pick_group(groups: list[ReasonGroup[Id]], reason: str) -> ReasonGroup[Id] | None:
    """The group that ``reason`` (a fingerprint or an unambiguous prefix of one) names, or
    None when no failed row has that cause (any more). A prefix that is too short, or that
    names several groups, is an error."""
    wanted = reason.strip().lower()
    if len(wanted) < MIN_PREFIX or not re.fullmatch(r"[0-9a-f]+", wanted):
        raise OutboxError(
            f"--reason {reason!r} is not a fingerprint: give the FINGERPRINT column of "
            f"--by-reason (at least {MIN_PREFIX} hex digits)"
        )
    matching = [g for g in groups if g.fingerprint.startswith(wanted)]
    if len(matching) > 1:
        names = ", ".join(g.fingerprint for g in matching)
        raise OutboxError(f"--reason {reason} names several causes ({names}): give more digits")
    return matching[0] if matching else None


def ids_of_reason(rows: Iterable[FailedRow[Id]], reason: str) -> list[Id]:
    """The ids of the ``rows`` whose cause ``reason`` names (see :func:`pick_group`); none
    when no row has that cause (any more)."""
    group = pick_group(group_by_reason(rows), reason)
    return group.ids if group is not None else []


def by_reason_lines(rows: Iterable[FailedRow[Id]], limit: int, seen: str, noun: str) -> list[str]:
    """What ``--by-reason`` prints: the ``limit`` largest causes of ``rows``
    (:func:`format_groups`), then how many rows (``noun``) and causes there are."""
    groups = group_by_reason(rows)
    total = sum(group.count for group in groups)
    return [*format_groups(groups[:limit], seen), f"{total} {noun}, {len(groups)} cause(s)"]


def format_groups(groups: list[ReasonGroup[Id]], seen: str = "seen") -> list[str]:
    """The lines of ``--by-reason``: one per cause, its pattern, and its latest error as
    written (``seen`` names what the times are: "seen", "written")."""
    lines = [
        f"{'FINGERPRINT':<{FINGERPRINT_LENGTH}}  {'COUNT':>7}  {f'FIRST {seen}'.upper():<19}  "
        f"{f'LAST {seen}'.upper():<19}  CLASS: PATTERN  (times in UTC)"
    ]
    for g in groups:
        lines.append(
            f"{g.fingerprint}  {g.count:>7}  {g.first_seen.astimezone(UTC):%Y-%m-%d %H:%M:%S}  "
            f"{g.last_seen.astimezone(UTC):%Y-%m-%d %H:%M:%S}  {g.kind}: {g.pattern[:160]}"
        )
        topics = ", ".join(sorted(g.topics)[:5]) + (" ..." if len(g.topics) > 5 else "")
        latest = error_line(g.example)[:160]
        lines.append(f"{'':<{FINGERPRINT_LENGTH}}  topics: {topics}; latest: {latest}")
    return lines
