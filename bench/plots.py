"""Plots of the benchmarks' figures, drawn from the JSON object each run prints last.

``make bench-relay BENCH_ARGS='--plot docs/img'`` and ``make bench-write BENCH_ARGS='--plot
docs/img'`` draw them at the end of a run; ``python -m bench.plots --relay relay.json --write
write.json --out docs/img`` draws them again from saved figures (the last line of a run's
output). Each plot is a PNG named after what it shows, so a run replaces the previous one's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RELAY_THROUGHPUT = "relay-throughput.png"
RELAY_LATENCY = "relay-latency.png"
LATENCY_FLOOR_MS = 0.1
WRITE_THROUGHPUT = "write-throughput.png"

#: The relay runs in the order a reader compares them: the limits first, then each mode.
RELAY_BARS = (
    ("bare producer", "bare producer"),
    ("Kafka Java producer, steady", "Java producer, steady"),
    ("Kafka Java producer, same count", "Java producer, same count"),
    ("Kafka Java producer", "Java producer"),  # figures saved before the steady run
    ("bare PG read+mark", "bare PG read+mark"),
    ("relay at-least-once x1", "at-least-once x1"),
    ("relay at-least-once x3", "at-least-once x3"),
    ("relay exactly-once x1", "exactly-once x1"),
    ("relay exactly-once x3", "exactly-once x3"),
    ("relay keep-nothing x1", "keep-nothing x1"),
    ("relay keep-nothing x3", "keep-nothing x3"),
)

#: pgbench's three tables, as the write benchmark names them, and what each one is.
WRITE_TABLES = (
    ("shape", "outbox-shaped table, no wake-up"),
    ("outbox", "outbox table (wake trigger)"),
    ("rule", "former NOTIFY-per-insert rule"),
)

#: The Python API's transaction kinds, as the write benchmark's table names them.
WRITE_KINDS = {
    "bare": "a: order row",
    "plain": "b: + PK-only row",
    "outbox": "c: + outbox message",
    "bulk10": "d: + ten messages",
    "shape": "e: + same-shape row, plain SQL",
}


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display on a server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def relay_plots(figures: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Throughput per configuration and mode, and commit-to-ack latency against the rate."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    rates: Mapping[str, float] = figures["msgs_per_s"]
    bars = [(name, label, rates[name]) for name, label in RELAY_BARS if name in rates]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.barh(
        [label for _, label, _ in bars],
        [rate for _, _, rate in bars],
        color=["#1f77b4" if name.startswith("relay") else "#9e9e9e" for name, _, _ in bars],
    )
    for index, (_, _, rate) in enumerate(bars):
        ax.text(rate, index, f" {rate:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("messages per second")
    ax.set_title(f"Relay throughput ({figures['n']:,} messages; grey: limits in the same run)")
    fig.tight_layout()
    throughput = out_dir / RELAY_THROUGHPUT
    fig.savefig(throughput, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for source, label, style in (
        ("latency_ms", "relay, commit to ack", "-o"),
        ("bare_producer_latency_ms", "bare producer, send to ack", "--s"),
    ):
        by_rate: Mapping[str, Mapping[str, float]] = figures.get(source, {})
        xs = sorted(int(rate) for rate in by_rate)
        for percentile in ("p50", "p99"):
            ax.plot(
                xs,
                # Append times are whole milliseconds, so a sub-millisecond figure can read
                # 0 or below: drawn at the axis' floor instead of left off the log scale.
                [max(LATENCY_FLOOR_MS, by_rate[str(x)][percentile]) for x in xs],
                style,
                label=f"{label} {percentile}",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("messages per second")
    ax.set_ylabel(f"milliseconds (values under {LATENCY_FLOOR_MS} drawn at it)")
    ax.set_title("Latency percentiles against the rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    latency = out_dir / RELAY_LATENCY
    fig.savefig(latency, dpi=110)
    plt.close(fig)
    return [throughput, latency]


def write_plots(figures: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Writer transactions per second against the number of writers (pgbench and Python)."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=False)
    pgbench: Mapping[str, Mapping[str, float]] = figures["pgbench_tps"]
    writers = sorted(int(w) for w in pgbench)
    for table, label in WRITE_TABLES:
        left.plot(writers, [pgbench[str(w)][table] for w in writers], "-o", label=label)
    left.set_title("pgbench: order row + message row")
    python: Mapping[str, Mapping[str, float]] = figures.get("python_tps", {})
    python_writers = sorted(int(w) for w in python)
    kinds = sorted({kind for by_kind in python.values() for kind in by_kind})
    for kind in kinds:
        right.plot(
            python_writers,
            [python[str(w)].get(kind, 0) for w in python_writers],
            "-o",
            label=WRITE_KINDS.get(kind, kind),
        )
    right.set_title("Python API, per transaction kind")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(writers, [str(w) for w in writers])
        ax.set_xlabel("concurrent writers")
        ax.set_ylabel("transactions per second")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / WRITE_THROUGHPUT
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _last_json_object(path: Path) -> dict[str, Any]:
    """The figures of a saved run: its output's last line that parses as a JSON object."""
    for line in reversed(path.read_text().splitlines()):
        if line.startswith("{"):
            loaded: dict[str, Any] = json.loads(line)
            return loaded
    raise SystemExit(f"{path}: no JSON object of figures in it")


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--relay", type=Path, help="saved output of bench.relay_throughput")
    parser.add_argument("--write", type=Path, help="saved output of bench.write_path")
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
    args = parser.parse_args(argv)
    drawn: list[Path] = []
    if args.relay:
        drawn += relay_plots(_last_json_object(args.relay), args.out)
    if args.write:
        drawn += write_plots(_last_json_object(args.write), args.out)
    for path in drawn:
        print(path)
    return drawn


if __name__ == "__main__":
    main()
