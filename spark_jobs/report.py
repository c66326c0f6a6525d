"""The outcome of one reconciliation run: thresholds, verdict, console table and JSON summary.

Pure Python on the handful of counts the job collects, so it is tested without Spark.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from outbox.spark_jobs.classes import CLASSES, DUPLICATE
from outbox.spark_jobs.delivery import Delivery
from outbox.spark_jobs.window import AuditWindow


def parse_thresholds(
    items: Iterable[str], defaults: Mapping[str, int | None] | None = None
) -> dict[str, int | None]:
    """``["duplicate=10", "late=100"]`` -> the largest count each class may reach.

    The rest keep ``defaults`` (0 for every class when not given); None means no limit.
    """
    limits: dict[str, int | None] = dict(defaults or dict.fromkeys(CLASSES, 0))
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in limits:
            raise ValueError(
                f"{item!r}: expected CLASS=COUNT with CLASS one of {', '.join(CLASSES)}"
            )
        try:
            limit = int(value)
        except ValueError:
            raise ValueError(f"{item!r}: the count must be a whole number") from None
        if limit < 0:
            raise ValueError(f"{item!r}: the count cannot be negative")
        limits[name] = limit
    return limits


@dataclass(frozen=True)
class RunSummary:
    """What one run found, and whether it passes."""

    run_id: str
    window: AuditWindow
    source: str
    outbox_rows: int
    topic_records: int
    counts: Mapping[tuple[str, str], int]
    #: The largest count each class may reach; None: no limit (still counted and shown).
    limits: Mapping[str, int | None]
    seconds: float
    output: str
    repaired: int | None = None
    topics: tuple[str, ...] = field(default=())
    #: Why the clocks look out of step (see ``discrepancies.skew_beyond``), or None.
    clock_skew: str | None = None
    #: What the run measured of the clocks (``discrepancies.clock_skew``), in seconds.
    clock_seconds: Mapping[str, float | None] = field(default_factory=dict)
    #: Why ``--repair`` requeued nothing, or None.
    repair_refused: str | None = None
    #: Topics read although none of their rows is in the window (earlier runs audited them).
    topics_without_rows: tuple[str, ...] = field(default=())
    #: Which topics were audited, in words (``topics`` lists them).
    topic_scope: str = ""
    #: The run's directory (``output`` is its discrepancy rows).
    run_dir: str = ""
    started_at: datetime | None = None
    #: The outbox table audited, ``schema.table``.
    table: str = ""
    #: The delivery mode the default limits were chosen for (see ``delivery.decide``).
    delivery: Delivery | None = None

    def per_class(self) -> dict[str, int]:
        totals = dict.fromkeys(CLASSES, 0)
        for (name, _topic), count in self.counts.items():
            totals[name] += count
        return totals

    def per_topic(self) -> dict[str, dict[str, int]]:
        by_topic: dict[str, dict[str, int]] = {}
        for (name, topic), count in sorted(self.counts.items()):
            by_topic.setdefault(topic, {})[name] = count
        return by_topic

    def limit(self, name: str) -> int | None:
        """The largest count class ``name`` may reach (None: no limit)."""
        return self.limits.get(name, 0)

    def breaches(self) -> dict[str, tuple[int, int]]:
        """Classes over their limit: ``{class: (count, limit)}``."""
        over = {}
        for name, count in self.per_class().items():
            limit = self.limit(name)
            if limit is not None and count > limit:
                over[name] = (count, limit)
        return over

    @property
    def passed(self) -> bool:
        return not self.breaches()

    @property
    def exit_code(self) -> int:
        """0 when every class is within its limit, 1 otherwise (so a scheduler alerts), 3 when
        a repair was asked for and refused."""
        if self.repair_refused:
            return 3
        return 0 if self.passed else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "started_at": self.started_at.isoformat() if self.started_at else None,
            "table": self.table,
            "delivery": self.delivery.to_json() if self.delivery else None,
            "window": {
                "start": self.window.start.isoformat(),
                "end": self.window.end.isoformat(),
                "grace_seconds": self.window.grace.total_seconds(),
            },
            "source": self.source,
            "topics": list(self.topics),
            "topic_scope": self.topic_scope,
            "topics_without_rows": list(self.topics_without_rows),
            "outbox_rows": self.outbox_rows,
            "topic_records": self.topic_records,
            "discrepancies": self.per_class(),
            "by_topic": self.per_topic(),
            "limits": dict(self.limits),
            "breaches": {k: {"count": c, "limit": m} for k, (c, m) in self.breaches().items()},
            "verdict": "pass" if self.passed else "fail",
            "repaired": self.repaired,
            "clock_skew": self.clock_skew,
            "clock_seconds": dict(self.clock_seconds),
            "repair_refused": self.repair_refused,
            "records_read_until": self.window.records_read_until.isoformat(),
            "seconds": round(self.seconds, 3),
            "output": self.output,
        }


def render(summary: RunSummary) -> str:
    """The console report: one line per class, then the topics that have discrepancies."""
    lines = [
        f"reconciliation {summary.run_id}",
        f"  window         {summary.window.describe()}",
        f"  source         {summary.source}",
        f"  topics         {_topics(summary)}",
        f"  outbox rows    {summary.outbox_rows:,}",
        f"  topic records  {summary.topic_records:,}",
        f"  run time       {summary.seconds:.1f}s",
        *_delivery(summary),
        "",
        f"  {'class':<18}{'count':>10}{'limit':>8}",
    ]
    breaches = summary.breaches()
    for name, count in summary.per_class().items():
        flag = "  FAIL" if name in breaches else ""
        limit = summary.limit(name)
        shown = "-" if limit is None else f"{limit:,}"
        lines.append(f"  {name:<18}{count:>10,}{shown:>8}{flag}")
    by_topic = summary.per_topic()
    if by_topic:
        lines.append("")
        lines.append("  by topic")
        for topic, counts in by_topic.items():
            listed = ", ".join(f"{name} {count:,}" for name, count in counts.items())
            lines.append(f"    {topic}: {listed}")
    if summary.clock_skew:
        lines.append("")
        lines.append(f"  clock skew     {summary.clock_skew}")
    if summary.repaired is not None:
        lines.append("")
        lines.append(f"  repair         {summary.repaired:,} missing messages put back to pending")
    if summary.repair_refused:
        lines.append("")
        lines.append(
            f"  repair refused {summary.repair_refused}: what looks missing may be records the "
            "read did not reach; fix the clocks, or widen --grace, or pass --repair-despite-skew"
        )
    lines.append("")
    if summary.run_dir:
        lines.append(f"  run directory  {summary.run_dir}")
        lines.append(f"  the ids        outbox reconcile show {summary.run_dir}")
    else:
        lines.append(f"  discrepancy rows: {summary.output}")
    if breaches:
        listed = ", ".join(f"{n} {c:,} > {m:,}" for n, (c, m) in breaches.items())
        lines.append(f"verdict: FAIL ({listed})")
    else:
        total = sum(summary.per_class().values())
        lines.append(f"verdict: PASS ({total:,} discrepancies, all within limits)")
    return "\n".join(lines)


def _topics(summary: RunSummary, shown: int = 6) -> str:
    """``2: orders, payments`` (the first few by name), then why these."""
    if not summary.topics:
        return summary.topic_scope or "-"
    names = ", ".join(summary.topics[:shown])
    if len(summary.topics) > shown:
        names += f", ... ({len(summary.topics) - shown} more in summary.json)"
    text = f"{len(summary.topics)}: {names}"
    if summary.topics_without_rows:
        text += (
            f"; {len(summary.topics_without_rows)} without rows in the window, audited as "
            f"earlier runs did: {', '.join(summary.topics_without_rows[:shown])}"
        )
    return text


def _delivery(summary: RunSummary) -> list[str]:
    """The delivery line: the mode assumed, how the run knows, what it means for duplicates."""
    if summary.delivery is None:
        return []
    line = f"  delivery       {summary.delivery.mode} ({summary.delivery.reason})"
    if summary.limit(DUPLICATE) is None:
        line += "; duplicates are counted, not limited (--max duplicate=N limits them)"
    return [line]
