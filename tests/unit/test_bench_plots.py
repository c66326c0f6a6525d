"""The benchmarks' plots are drawn from the figures a run prints, and a saved run replots."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from bench import plots

RELAY_FIGURES = {
    "n": 200_000,
    "msgs_per_s": {
        "bare producer": 45_000,
        "Kafka Java producer": 94_000,
        "bare PG read+mark": 41_000,
        "relay at-least-once x1": 40_000,
        "relay exactly-once x1": 37_000,
        "relay at-least-once x3": 48_000,
    },
    "latency_ms": {
        "1000": {"p50": 1.9, "p99": 3.1, "messages": 20_000},
        "10000": {"p50": 6.0, "p99": 25.0, "messages": 200_000},
    },
    "bare_producer_latency_ms": {
        "1000": {"p50": 1.1, "p99": 2.0, "messages": 20_000},
        "10000": {"p50": 2.5, "p99": 9.0, "messages": 200_000},
    },
}

WRITE_FIGURES = {
    "pgbench_tps": {
        "1": {"shape": 2234, "outbox": 2242, "rule": 2235},
        "16": {"shape": 5305, "outbox": 4919, "rule": 2747},
    },
    "python_tps": {"1": {"outbox": 1195, "shape": 1251}, "16": {"outbox": 2080, "shape": 2400}},
}


def _size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


def test_relay_figures_become_a_throughput_and_a_latency_plot(tmp_path: Path) -> None:
    drawn = plots.relay_plots(RELAY_FIGURES, tmp_path / "img")
    assert [path.name for path in drawn] == [plots.RELAY_THROUGHPUT, plots.RELAY_LATENCY]
    for path in drawn:
        width, height = _size(path)
        assert width > 500 and height > 300


def test_a_saved_run_is_plotted_from_its_last_json_line(tmp_path: Path) -> None:
    relay_log = tmp_path / "relay.txt"
    relay_log.write_text("relay benchmark: ...\n  bare producer: 45,000 msgs/s\n")
    relay_log.write_text(relay_log.read_text() + json.dumps(RELAY_FIGURES) + "\n")
    write_log = tmp_path / "write.txt"
    write_log.write_text("write-path benchmark\n" + json.dumps(WRITE_FIGURES) + "\n")
    drawn = plots.main(
        ["--relay", str(relay_log), "--write", str(write_log), "--out", str(tmp_path / "out")]
    )
    assert sorted(path.name for path in drawn) == sorted(
        [plots.RELAY_THROUGHPUT, plots.RELAY_LATENCY, plots.WRITE_THROUGHPUT]
    )
    assert all(path.stat().st_size > 10_000 for path in drawn)
