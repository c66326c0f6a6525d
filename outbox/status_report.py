"""``outbox status`` as a table for a person or as JSON for a script."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import orjson

from outbox.schema import PENDING, PREPARED, SCHEDULED
from outbox.status import InboxStatus, OutboxStatus, ParkedCount
from outbox.wal.slots import SlotState

if TYPE_CHECKING:
    from outbox.inbox.lag import GroupLag


def to_json(status: OutboxStatus | InboxStatus) -> str:
    """The whole status as one JSON object (times in ISO 8601, ages in seconds)."""
    data = dataclasses.asdict(status)
    if isinstance(status, InboxStatus):
        data["dead_letters"] = None  # none can be written: no outbox table beside the inbox
        return orjson.dumps(data, option=orjson.OPT_INDENT_2, default=str).decode()
    data["oldest_pending_seconds"] = status.oldest_pending_seconds
    data["estimates_from"] = (
        None if status.exact else "the planner's statistics (last ANALYZE); --exact counts"
    )
    return orjson.dumps(data, option=orjson.OPT_INDENT_2, default=str).decode()


def age(seconds: float | None) -> str:
    """``3.2s``, ``4m05s``, ``2h13m``, ``3d04h``; ``-`` for none."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def shard_ranges(shards: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``; ``none`` for an empty list."""
    if not shards:
        return "none"
    parts: list[str] = []
    start = previous = shards[0]
    for shard in [*shards[1:], None]:
        if shard is not None and shard == previous + 1:
            previous = shard
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if shard is not None:
            start = previous = shard
    return ",".join(parts)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned first column, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(r)
        ).rstrip()
        for r in [header, *rows]
    ]


def _due_in(seconds: float | None) -> str:
    """Time until the next scheduled message is due; ``-`` for none, ``overdue`` when past."""
    if seconds is None:
        return "-"
    return "overdue" if seconds < 0 else age(seconds)


def wal_slot_line(slot: SlotState) -> str:
    """Who reads the WAL source's slot, and what it holds back."""
    reader = f"read by pid {slot.active_pid}" if slot.active_pid else "not read"
    if slot.wal_status == "lost":
        return f"WAL slot {slot.name}: {reader}, LOST (invalidated: its WAL was removed)"
    limit = (
        "no max_slot_wal_keep_size"
        if slot.safe_bytes is None
        else f"{_size(slot.safe_bytes)} more before max_slot_wal_keep_size invalidates it"
    )
    return (
        f"WAL slot {slot.name}: {reader}, holds {_size(slot.held_bytes)} of WAL "
        f"({slot.wal_status}; {limit})"
    )


def _size(value: int | None) -> str:
    if value is None:
        return "?"
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if abs(value) >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value} B"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _parked_lines(table: str, parked: list[ParkedCount]) -> list[str]:
    lines = [f"parked inbox messages ({table}):"]
    if not parked:
        return [*lines, "none"]
    return lines + _table(
        ["GROUP", "TOPIC", "STATUS", "COUNT", "OLDEST"],
        [
            [p.consumer_group, p.topic, p.status, _count(p.count), age(p.oldest_seconds)]
            for p in parked
        ],
    )


def _lag_lines(lag: list[GroupLag] | None) -> list[str]:
    if lag is None:
        return ["consumer lag: not asked for (--bootstrap-servers reads it from Kafka)"]
    if not lag:
        return ["consumer lag: no consumer group here"]
    rows = [[g.group, "?" if g.total is None else f"{g.total:,}", g.error or ""] for g in lag]
    return ["consumer lag (from Kafka):", *_table(["GROUP", "LAG", "ERROR"], rows)]


def inbox_to_text(status: InboxStatus) -> list[str]:
    """A consumer's own database (inbox tables, no outbox table) as lines for a terminal."""
    taken = status.taken_at.astimezone(UTC) if isinstance(status.taken_at, datetime) else None
    lines = [
        f"inbox {status.table} at {taken:%Y-%m-%d %H:%M:%S} UTC (no outbox table "
        f"{status.outbox_table} in this database)",
        "",
        f"consumer groups: {', '.join(status.groups) or 'none yet'}",
        "",
        *_parked_lines(status.parked_table, status.parked),
        "",
        "dead letters: none (they are written through an outbox table beside the inbox "
        "tables; this database has none)",
        "",
        *_lag_lines(status.lag),
    ]
    return lines


def to_text(status: OutboxStatus) -> list[str]:
    """The status as lines for a terminal."""
    taken = status.taken_at.astimezone(UTC) if isinstance(status.taken_at, datetime) else None
    lines = [f"outbox {status.table} at {taken:%Y-%m-%d %H:%M:%S} UTC", ""]

    counts = []
    for name, count in status.statuses.items():
        shown = "?" if count.count is None else f"{'~' if count.estimate else ''}{count.count:,}"
        counts.append(f"{name} {shown}")
    lines.append("messages: " + ", ".join(counts))
    if not status.exact:
        lines.append(
            "  pending, prepared and scheduled: exact; ~: estimated from the planner's statistics"
            " (a status too rare for ANALYZE's sample reads ~0); ?: not analyzed yet; --exact:"
            " one scan"
        )
    lines.append(f"oldest pending: {age(status.oldest_pending_seconds)}")
    if status.overdue:
        lines.append(
            f"overdue scheduled: {status.overdue:,} (due over a second ago, not pending yet:"
            " is a relay running?)"
        )
    lines.append("")

    header = ["TOPIC", "PENDING", "BACKING OFF", "OLDEST PENDING", "PREPARED", "OLDEST PREPARED"]
    header += ["SCHEDULED", "OVERDUE", "NEXT DUE IN"]
    if status.exact:
        header += ["SENT", "DEAD", "ROLLED BACK", "CANCELLED"]
    rows = []
    for t in status.topics:
        row = [
            t.topic,
            _count(t.pending),
            _count(t.backing_off),
            age(t.oldest_pending_seconds),
            _count(t.prepared),
            age(t.oldest_prepared_seconds),
            _count(t.scheduled),
            _count(t.overdue),
            _due_in(t.next_due_seconds),
        ]
        if status.exact:
            row += [_count(t.sent), _count(t.dead), _count(t.rolled_back), _count(t.cancelled)]
        rows.append(row)
    if rows:
        lines += _table(header, rows)
    else:
        lines.append(
            f"no {PENDING}, {PREPARED} or {SCHEDULED} messages"
            + ("" if status.exact else " (per-topic counts of the other statuses: --exact)")
        )
    lines.append("")

    lines.append(f"relays: {len(status.relays)} connected")
    relay_rows = [
        [
            r.name,
            str(r.pid),
            r.client_addr or "local",
            r.connected_since.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
            if r.connected_since
            else "-",
            "serving" if r.serving else ("member" if r.member else "not a member"),
            shard_ranges(r.shards),
        ]
        for r in status.relays
    ]
    if relay_rows:
        lines += _table(["RELAY", "PID", "FROM", "SINCE (UTC)", "STATE", "SHARDS"], relay_rows)
    unowned = shard_ranges(status.unowned_shards)
    lines.append(f"unowned shards: {unowned} (of {status.shard_count})")

    if status.wal_slot is not None:
        lines += ["", wal_slot_line(status.wal_slot)]

    if status.prepared_groups:
        lines += ["", "prepared messages waiting for a verdict:"]
        lines += _table(
            ["CHECK GROUP", "WAITING", "OLDEST"],
            [
                [g.check_group, _count(g.count), age(g.oldest_seconds)]
                for g in status.prepared_groups
            ],
        )
    if status.inbox_table is not None:
        lines += ["", *_parked_lines(status.inbox_table, status.parked)]
    if status.lag is not None:
        lines += ["", *_lag_lines(status.lag)]
    return lines
