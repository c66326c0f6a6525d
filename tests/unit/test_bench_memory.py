"""The relay benchmark's memory figure: growth with messages, not with start-up."""

from bench.relay_throughput import second_half_growth


def test_start_up_growth_does_not_count() -> None:
    samples = [(0, 70.0), (10_000, 150.0), (50_000, 165.0), (80_000, 166.0), (100_000, 168.0)]
    assert second_half_growth(samples, 100_000) == 168.0 / 165.0


def test_growth_with_messages_shows() -> None:
    samples = [(0, 70.0), (25_000, 100.0), (50_000, 130.0), (75_000, 160.0), (100_000, 190.0)]
    assert second_half_growth(samples, 100_000) == 190.0 / 130.0


def test_too_few_samples_say_flat() -> None:
    assert second_half_growth([], 100_000) == 1.0
    assert second_half_growth([(0, 70.0)], 100_000) == 1.0
