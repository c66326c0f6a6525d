"""Where reconciliation runs keep their evidence, and reading it back without Spark.

Every run writes to a directory of its own under a base directory, so no run replaces
another's evidence::

    <base>/<window>/<UTC start>-<random>/   the run's directory; its id is the path below <base>
        summary.json                          counts, limits, verdict, topics audited
        discrepancies/                        one Parquet row per discrepancy
        discrepancies-json/part-*.json        the same rows as JSON lines, by class and id

``<window>`` is ``2026-11-21`` for a UTC day, ``20261121T100000Z-20261121T110000Z`` for any
other span. ``outbox reconcile show`` and ``list`` read these files with plain Python, so they
work where PySpark is not installed.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from outbox.spark_jobs.classes import CLASSES
from outbox.spark_jobs.window import AuditWindow

#: Where runs go when no ``--output`` is given (relative to the working directory).
DEFAULT_BASE = "reconciliation"
SUMMARY = "summary.json"
ROWS = "discrepancies"
ROWS_JSON = "discrepancies-json"


def new_run_id(window: AuditWindow, started: datetime) -> str:
    """``<window label>/<UTC start>-<6 random hex digits>``: unique, sorting by start time."""
    return f"{window.label()}/{started.astimezone(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def run_dir(base: str, run_id: str) -> str:
    """The run's directory under ``base`` (a local path or a URI such as ``s3a://...``)."""
    return f"{base.rstrip('/')}/{run_id}" if base else run_id


class RunNotFound(LookupError):
    """No run directory (with a ``summary.json``) answers to the name given."""


@dataclass(frozen=True)
class Run:
    """A finished run, as its ``summary.json`` describes it."""

    path: Path
    summary: Mapping[str, Any]

    @property
    def run_id(self) -> str:
        return str(self.summary.get("run_id") or self.path.name)

    @property
    def started_at(self) -> str:
        return str(self.summary.get("started_at") or "")

    def counts(self) -> dict[str, int]:
        found = self.summary.get("discrepancies") or {}
        return {name: int(found.get(name, 0)) for name in CLASSES}

    def rows(self, classes: Sequence[str] = CLASSES) -> Iterator[dict[str, Any]]:
        """The discrepancy rows of ``classes`` (from the JSON lines written beside the Parquet),
        ordered by class and message id."""
        folder = self.path / ROWS_JSON
        if not folder.is_dir():
            raise RunNotFound(
                f"{self.path} has no {ROWS_JSON}/ (written by runs since it was added); "
                f"read {self.path / ROWS} with Spark or pyarrow instead"
            )
        wanted = set(classes)
        for part in sorted(folder.glob("part-*")):
            with part.open() as lines:
                for line in lines:
                    if line.strip():
                        row = json.loads(line)
                        if row.get("class") in wanted:
                            yield row

    def rows_by_class(
        self, classes: Sequence[str] = CLASSES, limit: int | None = None
    ) -> dict[str, list[dict[str, Any]]]:
        """Up to ``limit`` rows per class (all when None), in class order."""
        by_class: dict[str, list[dict[str, Any]]] = {name: [] for name in classes}
        for row in self.rows(classes):
            listed = by_class[row["class"]]
            if limit is None or len(listed) < limit:
                listed.append(row)
        return by_class


def load_run(path: Path) -> Run:
    summary_file = path / SUMMARY
    try:
        return Run(path, json.loads(summary_file.read_text()))
    except FileNotFoundError:
        raise RunNotFound(f"{path} is not a reconciliation run (it has no {SUMMARY})") from None
    except json.JSONDecodeError as exc:
        raise RunNotFound(f"{summary_file} is not valid JSON: {exc}") from None


def list_runs(base: Path) -> list[Run]:
    """Every run under ``base``, newest first."""
    runs = []
    for summary_file in base.glob(f"*/*/{SUMMARY}"):
        try:
            runs.append(load_run(summary_file.parent))
        except RunNotFound:
            continue  # a run still being written, or a stray file
    return sorted(runs, key=lambda run: (run.started_at, run.path.name), reverse=True)


def find_run(name: str, base: Path) -> Run:
    """A run by its directory, its id under ``base``, or ``latest``."""
    if name == "latest":
        runs = list_runs(base)
        if not runs:
            raise RunNotFound(f"no runs under {base}")
        return runs[0]
    for candidate in (Path(name), base / name):
        if (candidate / SUMMARY).is_file():
            return load_run(candidate)
    raise RunNotFound(f"no run {name!r}: neither a run directory nor a run id under {base}")


def earlier_topics(base: Path, table: str) -> list[str]:
    """The topics earlier runs of the outbox table ``table`` audited, from their summaries.

    A topic whose rows were all purged has none in a later window, but its records still need
    auditing (they are phantoms now): remembering it keeps it in the audit.
    """
    seen: set[str] = set()
    for run in list_runs(base) if base.is_dir() else ():
        if run.summary.get("table") in (None, table):
            seen.update(str(topic) for topic in run.summary.get("topics") or ())
    return sorted(seen)


def render_run(run: Run, rows: Mapping[str, list[dict[str, Any]]], limit: int | None) -> str:
    """``outbox reconcile show``: the run, then per class its count and the listed rows."""
    window = run.summary.get("window") or {}
    counts = run.counts()
    lines = [
        f"run {run.run_id}",
        f"  directory  {run.path}",
        f"  window     {window.get('start')} .. {window.get('end')}",
        f"  topics     {', '.join(run.summary.get('topics') or []) or '-'}",
        f"  verdict    {str(run.summary.get('verdict', '?')).upper()}",
    ]
    for name, listed in rows.items():
        lines.append("")
        lines.append(f"{name}: {counts.get(name, 0):,}")
        for row in listed:
            fields = (
                row.get("message_id"),
                row.get("topic"),
                row.get("made_at"),
                row.get("detail"),
            )
            lines.append("  " + "  ".join(str(f) if f is not None else "-" for f in fields))
        hidden = counts.get(name, 0) - len(listed)
        if hidden > 0 and limit is not None:
            lines.append(f"  ... {hidden:,} more (--limit 0 lists all)")
    if not rows:
        lines.append("")
        lines.append("no discrepancies")
    return "\n".join(lines)


def render_runs(runs: Iterable[Run]) -> str:
    """``outbox reconcile list``: one line per run, newest first."""
    runs = list(runs)
    width = max([len("run"), *(len(run.run_id) for run in runs)]) + 2
    lines = [f"{'run':<{width}}{'verdict':<9}discrepancies"]
    for run in runs:
        found = ", ".join(f"{name} {count:,}" for name, count in run.counts().items() if count)
        verdict = str(run.summary.get("verdict", "?")).upper()
        lines.append(f"{run.run_id:<{width}}{verdict:<9}{found or '0'}")
    return "\n".join(lines)
