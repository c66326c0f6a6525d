"""The Java baseline's steady rate: ProducerPerformance's windows after its first."""

from __future__ import annotations

import pytest

from bench.relay_throughput import steady_windows

# As Kafka 4.1's ProducerPerformance prints them every 5 s (cut at "max").
OUTPUT = """\
100141 records sent, 20024.2 records/sec (4.89 MB/sec), 1032.4 ms avg latency, 1803.0 ms max
600360 records sent, 120072.0 records/sec (29.31 MB/sec), 180.1 ms avg latency, 420.0 ms max
590010 records sent, 118002.0 records/sec (28.81 MB/sec), 175.5 ms avg latency, 390.0 ms max
"""


def test_the_first_window_the_jvms_warm_up_is_left_out() -> None:
    records, seconds = steady_windows(OUTPUT.splitlines())
    assert records == 600360 + 590010
    assert seconds == pytest.approx(10.0)
    assert records / seconds == pytest.approx(119_037, rel=1e-3)


def test_a_run_too_short_for_a_steady_window_says_so() -> None:
    with pytest.raises(RuntimeError, match=r"1 windows.*--java-seconds"):
        steady_windows(OUTPUT.splitlines()[:1])
